"""The child behind synth.probe: ``python -m synth.probe_worker REQUEST.json`` prints a ProbeResult.

Generated code runs here only through EnvRuntime and Episode (allowlisted tools, argument schemas,
time limits). Tool return values are additionally required to be JSON as they are: the runtime would
quietly convert a set or a datetime, but a generated environment must not rely on that.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

from envscaler.errors import EnvScalerError
from envscaler.guard import protect_time_limits
from envscaler.jsonl import dumps
from envscaler.runtime import EnvRuntime
from synth.probe import Instantiation, ProbeRequest, ProbeResult, ProbeRun


def _strict(name: str, method: Any) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        value = method(*args, **kwargs)
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the return value of {name} is not JSON-serialisable ({e})") from None
        return value

    return call


def run(request: ProbeRequest) -> ProbeResult:
    """Load the class, instantiate each init_config, run each case."""
    try:
        runtime = EnvRuntime(request.spec, call_timeout_s=5.0, check_timeout_s=2.0)
    except EnvScalerError as e:
        return ProbeResult(class_error=str(e))
    for name in runtime.tools:
        setattr(runtime.env_class, name, _strict(name, getattr(runtime.env_class, name)))
    result = ProbeResult(tools=runtime.tool_list())
    for config in request.init_configs:
        try:
            episode = runtime.new_episode(config)
        except EnvScalerError as e:
            result.instances.append(Instantiation(error=str(e)))
            continue
        result.instances.append(Instantiation(state=episode.state(), conversions=episode.conversions))
    for case in request.cases:
        try:
            episode = runtime.new_episode(case.init_config)
        except EnvScalerError as e:
            result.runs.append(ProbeRun(error=str(e)))
            continue
        outcomes = [episode.call(call.name, call.arguments) for call in case.calls]
        result.runs.append(ProbeRun(outcomes=outcomes, conversions=episode.conversions))
    return result


def main(argv: list[str] | None = None) -> int:
    """Read the request file named on the command line and print the result as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m synth.probe_worker REQUEST.json", file=sys.stderr)
        return 2
    request = ProbeRequest.model_validate_json(Path(args[0]).read_text(encoding="utf-8"))
    protect_time_limits()
    print(dumps(run(request)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
