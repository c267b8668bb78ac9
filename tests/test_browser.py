"""Browser-hosted MCP clients: CORS on ``serve`` and on the farm's gateway, seen from a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tests.support.bundles import counter_bundle
from tests.support.farm import counter_farm
from tests.support.server import serve

CHROMIUM = shutil.which("chromium")
# What works on a closed network (/work/.library/env/machines/python.md): no background traffic, no sandbox as root.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

PAGE = """<html><body><pre id="out">pending</pre><script>
async function mcp(url, method, params) {
  const response = await fetch(url, {method: "POST", body: JSON.stringify({jsonrpc: "2.0", id: 1, method, params}),
    headers: {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
              "MCP-Protocol-Version": "2025-11-25"}});
  return {status: response.status, body: await response.json(),
          allowOrigin: response.headers.get("Access-Control-Allow-Origin")};
}
async function attempt(url) {
  try {
    const listed = await mcp(url, "tools/list", {});
    const called = await mcp(url, "tools/call", {name: "add", arguments: {item_id: "a", amount: 3}});
    return {tools: listed.body.result.tools.map(t => t.name), readOnly: listed.body.result.tools[0].annotations.readOnlyHint,
            call: called.body.result, status: called.status};
  } catch (error) {
    return {blocked: String(error)};
  }
}
(async () => {
  const results = {};
  for (const [name, url] of Object.entries(TARGETS)) results[name] = await attempt(url);
  document.getElementById("out").textContent = "RESULT" + JSON.stringify(results) + "END";
})();
</script></body></html>"""


class _Page(BaseHTTPRequestHandler):
    html = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.html)))
        self.end_headers()
        self.wfile.write(self.html)

    def log_message(self, *args: object) -> None:
        pass


def open_in_chromium(tmp_path, targets: dict[str, str]) -> dict:
    """Serve a page that calls each MCP URL with fetch from its own origin; Chromium runs it; its results."""
    assert CHROMIUM, "Debian's chromium is not installed: run .ci/run (it installs it)"
    handler = type("Page", (_Page,), {"html": PAGE.replace("TARGETS", json.dumps(targets)).encode()})
    page_server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=page_server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{page_server.server_address[1]}/"
        done = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                               "--virtual-time-budget=20000", "--dump-dom", url],
                              capture_output=True, text=True, timeout=120)
    finally:
        page_server.shutdown()
        page_server.server_close()
    match = re.search(r"RESULT(.*)END", done.stdout)
    assert match, f"the page did not finish: {done.stdout[-500:]} {done.stderr[-500:]}"
    return json.loads(match.group(1))



def new_episode(server) -> str:
    with server.client() as http:
        return http.post("/episodes", json={"scenario_id": "counter_001"}).json()["mcp_url"]


def test_preflight_and_cors_headers_on_serve(tmp_path):
    origin = "http://page.example"
    with serve(counter_bundle(tmp_path), "--allowed-origin", origin) as server:
        url = new_episode(server)
        preflight = httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "content-type, mcp-protocol-version"})
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == origin
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "mcp-protocol-version" in preflight.headers["access-control-allow-headers"].lower()
        reply = httpx.post(url, headers={"Origin": origin}, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin
        exposed = {h.strip().lower() for h in reply.headers["access-control-expose-headers"].split(",")}
        assert {"mcp-session-id", "mcp-protocol-version"} <= exposed
        other = "http://evil.example"
        assert httpx.options(url, headers={"Origin": other, "Access-Control-Request-Method": "POST"}).status_code == 403
        refused = httpx.post(url, headers={"Origin": other}, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers


def test_a_chromium_page_calls_an_episode_directly_and_through_the_gateway(tmp_path):
    bundle = counter_bundle(tmp_path / "bundles")
    # The page is served from 127.0.0.1 on a port chosen later: '*' allows it, and the gateway echoes it back.
    with counter_farm(tmp_path / "farm", "--allowed-origin", "*") as farm:
        headers = {"Authorization": f"Bearer {farm['envs']['counter']['token']}"}
        through_gateway = httpx.post(f"{farm['gateway']}/envs/counter/episodes", headers=headers,
                                     json={"scenario_id": "counter_001"}).json()["mcp_url"]
        preflight = httpx.options(through_gateway, headers={"Origin": "http://page.example", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == "http://page.example"
        with serve(bundle, "--allowed-origin", "*") as open_server, serve(bundle) as closed_server:
            results = open_in_chromium(tmp_path, {"direct": new_episode(open_server), "gateway": through_gateway,
                                                  "closed": new_episode(closed_server)})
    for name in ("direct", "gateway"):
        result = results[name]
        assert "add" in result["tools"] and result["readOnly"] is True, result
        assert result["status"] == 200 and result["call"]["isError"] is False
        assert json.loads(result["call"]["content"][0]["text"])["data"]["count"] == 3
    assert "Failed to fetch" in results["closed"]["blocked"]  # no --allowed-origin: the browser keeps the page out
