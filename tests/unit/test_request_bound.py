"""``mxload plan`` names what sends the requests that bound the slowest rank, and the
flags that would help with each one's predicted time (in-process, config only)."""

from __future__ import annotations

import json

import pytest
from mxload.orchestrator.cli.commands import main
from mxload.orchestrator.runtime.models import model_config


def plan_json(tmp_path, capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    raw = dict(model_config("qwen3-30b-a3b-fp8"), num_hidden_layers=4)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(raw))
    # the CPU rates these figures were worked out for (plan's default device is npu)
    assert main(["plan", "--config", str(cfg), "--device", "cpu", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tp_experts_name_the_cause_and_suggest_ep(tmp_path, capsys) -> None:
    got = plan_json(tmp_path, capsys, "--tp", "4")
    tm = got["time_model"]
    rb = tm["request_bound"]
    # 4 layers x 128 experts: w13 is a row slice of gate and up (2 weights, 2 scales),
    # w2 whole rows shared over the 4 TP ranks (1 weight, 1 scale request)
    assert tm["slowest_rank_requests_by_kind"]["moe_w13"] == 4 * 128 * 4
    assert tm["slowest_rank_requests_by_kind"]["moe_w2"] == 4 * 128 * 2
    assert "expert w13" in rb["cause"] and "every rank reads its slice" in rb["cause"]
    ep = {h["flags"]: h for h in rb["would_help"]}["--enable-expert-parallel"]
    assert ep["predicted_load_seconds"] < tm["predicted_load_seconds"]
    assert ep["requests_to_storage"] < tm["requests_to_storage"]


def test_no_advice_when_bytes_bound(tmp_path, capsys) -> None:
    got = plan_json(
        tmp_path, capsys, "--tp", "4", "--enable-expert-parallel", "--request-latency", "0.0001"
    )
    assert "request_bound" not in got["time_model"]
