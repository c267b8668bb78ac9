"""The wire contract: MCP constants equal the installed SDK's, and nothing on the runtime path imports mcp."""

from __future__ import annotations

import subprocess
import sys

import mcp_types
import mcp_types.jsonrpc
import mcp_types.version
import pytest
from mcp.shared import inbound

from envscaler import wire


def test_protocol_versions_and_meta_keys_are_the_sdks():
    assert wire.HANDSHAKE_PROTOCOL_VERSIONS == mcp_types.version.HANDSHAKE_PROTOCOL_VERSIONS
    assert wire.MODERN_PROTOCOL_VERSIONS == mcp_types.version.MODERN_PROTOCOL_VERSIONS
    assert wire.LATEST_HANDSHAKE_VERSION == mcp_types.version.LATEST_HANDSHAKE_VERSION
    assert wire.LATEST_MODERN_VERSION == mcp_types.version.LATEST_MODERN_VERSION
    assert wire.PROTOCOL_VERSION_META_KEY == mcp_types.PROTOCOL_VERSION_META_KEY
    assert wire.CLIENT_CAPABILITIES_META_KEY == mcp_types.CLIENT_CAPABILITIES_META_KEY
    assert wire.SERVER_INFO_META_KEY == mcp_types.SERVER_INFO_META_KEY


def test_header_names_error_codes_and_status_table_are_the_sdks():
    assert wire.MCP_PROTOCOL_VERSION_HEADER == inbound.MCP_PROTOCOL_VERSION_HEADER
    assert wire.MCP_METHOD_HEADER == inbound.MCP_METHOD_HEADER
    assert wire.MCP_NAME_HEADER == inbound.MCP_NAME_HEADER
    assert dict(wire.NAME_BEARING_METHODS) == dict(inbound.NAME_BEARING_METHODS)
    for name in ("PARSE_ERROR", "INVALID_REQUEST", "METHOD_NOT_FOUND", "INVALID_PARAMS", "HEADER_MISMATCH",
                 "MISSING_REQUIRED_CLIENT_CAPABILITY", "UNSUPPORTED_PROTOCOL_VERSION"):
        assert getattr(wire, name) == getattr(mcp_types.jsonrpc, name), name
    assert dict(wire.ERROR_CODE_HTTP_STATUS) == dict(inbound.ERROR_CODE_HTTP_STATUS)


@pytest.mark.parametrize("value", ["add", "get item", " padded ", "naïve_tool", "=?base64?YWRk?=", "tab\there", ""])
def test_header_values_are_coded_as_the_sdk_codes_them(value):
    assert wire.encode_header_value(value) == inbound.encode_header_value(value)
    assert wire.decode_header_value(wire.encode_header_value(value)) == value


@pytest.mark.parametrize("raw", ["=?base64?not base64?=", "=?base64?YWRk=?=", "=?base64?/w==?=", None, "plain"])
def test_malformed_header_values_decode_as_the_sdk_decodes_them(raw):
    assert wire.decode_header_value(raw) == inbound.decode_header_value(raw)


def test_the_server_and_the_harness_do_not_import_mcp():
    code = ("import sys, envscaler, envscaler.wire, servers.app, servers.serve, agent_client.runner, agent_client.cli; "
            "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'mcp_types'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
