"""`eval.mode=server`: tau read from a serving engine, against a loopback HTTP server (127.0.0.1)
that answers in the documented formats of

- SGLang at commit c60799d0 (python/sglang/srt/managers/tokenizer_manager.py,
  `_calculate_spec_decoding_metrics`): POST /generate -> {"text", "output_ids", "meta_info":
  {"completion_tokens", "spec_verify_ct", "spec_accept_length" = completion_tokens / spec_verify_ct}};
- vLLM v0.32.0 (docs features/speculative_decoding/acceptance_metrics and its
  tests/.../test_per_request_spec_decode_metrics): POST /v1/completions -> {"choices", "usage",
  "metrics": {"speculative_decoding": {"mean_acceptance_length", "num_spec_steps",
  "num_accepted_draft_tokens", "num_draft_tokens", "draft_acceptance_rate"}}} when started with
  --per-request-spec-decode-metrics, else no such field and Prometheus counters
  vllm:spec_decode_num_drafts_total / vllm:spec_decode_num_accepted_tokens_total on /metrics.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from dflash_dist.evaluator.server import ServerError, ServerResult, server_tau
from tests.helpers.fake_engine import PROMPTS, FakeEngine, fake_rounds

MAX_NEW = 12
BLOCK = 16  # the served drafter's block size: no accept length above it


@pytest.fixture
def engine(request):
    flavour, fail_first = request.param
    srv = FakeEngine(flavour, fail_first)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _per_prompt_mean(per_request) -> float:
    values = [per_request(*fake_rounds(p)) for p in PROMPTS]
    return sum(values) / len(values)


@pytest.mark.parametrize("engine", [("sglang", 2)], indirect=True)
def test_sglang_meta_info_with_retries_and_bounded_concurrency(engine):
    res = server_tau(engine.url, "sglang", PROMPTS, MAX_NEW, BLOCK, concurrency=3, max_retries=3, timeout_s=10)
    assert res.source == "per_request" and res.requests == len(PROMPTS)
    assert res.tau == pytest.approx(_per_prompt_mean(lambda steps, acc: (steps + acc) / steps))
    assert engine.requests == len(PROMPTS) + 2  # two 503s retried
    assert 2 <= engine.max_in_flight <= 3
    assert ServerResult.from_json(json.loads(json.dumps(res.to_json()))) == res


@pytest.mark.parametrize("engine", [("vllm_per_request", 0)], indirect=True)
def test_vllm_per_request_metrics(engine):
    res = server_tau(engine.url + "/v1", "vllm", PROMPTS, MAX_NEW, BLOCK, model="served", concurrency=2, timeout_s=10)
    assert res.source == "per_request"
    assert res.tau == pytest.approx(_per_prompt_mean(lambda steps, acc: 1 + acc / steps))
    assert engine.max_in_flight <= 2


@pytest.mark.parametrize("engine", [("vllm_prometheus", 1)], indirect=True)
def test_vllm_prometheus_counter_deltas(engine):
    engine.drafts, engine.accepted = 100, 250  # earlier traffic: only the deltas count
    res = server_tau(engine.url, "vllm", PROMPTS, MAX_NEW, BLOCK, model="served", concurrency=4, timeout_s=10)
    steps = sum(fake_rounds(p)[0] for p in PROMPTS)
    accepted = sum(fake_rounds(p)[1] for p in PROMPTS)
    assert res.source == "prometheus" and res.per_prompt == ()
    assert res.tau == pytest.approx(1 + accepted / steps)


@pytest.mark.parametrize("engine", [("sglang", 10)], indirect=True)
def test_a_failing_server_is_an_error_naming_it(engine):
    with pytest.raises(ServerError, match=r"/generate: HTTP 503"):
        server_tau(engine.url, "sglang", PROMPTS[:1], MAX_NEW, BLOCK, max_retries=1, timeout_s=5)
    assert engine.requests == 2


@pytest.mark.parametrize("engine", [("vllm_plain", 0)], indirect=True)
def test_a_vllm_server_without_spec_metrics_is_refused_naming_the_flag(engine):
    with pytest.raises(ServerError, match="--per-request-spec-decode-metrics"):
        server_tau(engine.url, "vllm", PROMPTS[:2], MAX_NEW, BLOCK, model="served", max_retries=0, timeout_s=5)


# ---- the server is not trusted -----------------------------------------------------------------


def _sglang_answer(accept: str, extra: str = "") -> bytes:
    """An SGLang /generate answer with `accept` written verbatim as spec_accept_length."""
    return ('{"text": "x", "output_ids": [1, 2], "meta_info": {"completion_tokens": 7, "spec_verify_ct": 2, '
            f'"spec_accept_length": {accept}{extra}}}}}').encode()


def _vllm_answer(spec: str) -> bytes:
    return ('{"choices": [{"index": 0, "text": "x"}], "metrics": {"speculative_decoding": ' + spec + "}}").encode()


BAD_SGLANG = {
    "NaN": _sglang_answer("NaN"),
    "Infinity": _sglang_answer("Infinity"),
    "-Infinity": _sglang_answer("-Infinity"),
    "1e300": _sglang_answer("1e300"),
    "1e400 (overflows to inf)": _sglang_answer("1e400"),
    "-5": _sglang_answer("-5"),
    "0.5 (below 1)": _sglang_answer("0.5"),
    "17 (above the block)": _sglang_answer("17"),
    "a string": _sglang_answer('"3.5"'),
    "a bool": _sglang_answer("true"),
    "negative verify count": _sglang_answer("3.5", ', "spec_verify_ct": -2'),
    "fractional completion count": _sglang_answer("3.5", ', "completion_tokens": 7.5'),
    "more tokens than the verifies can make": _sglang_answer("3.5", ', "completion_tokens": 40'),
    "meta_info a list": b'{"text": "x", "meta_info": [1, 2]}',
    "top level a list": b"[1, 2, 3]",
    "not JSON": b"<html>502 Bad Gateway</html>",
    "truncated JSON": b'{"meta_info": {"spec_accept_length": 3',
}
BAD_VLLM = {
    "NaN": _vllm_answer('{"mean_acceptance_length": NaN}'),
    "1e300": _vllm_answer('{"mean_acceptance_length": 1e300}'),
    "-5": _vllm_answer('{"mean_acceptance_length": -5}'),
    "above the block": _vllm_answer('{"mean_acceptance_length": 16.5}'),
    "no mean_acceptance_length": _vllm_answer('{"num_spec_steps": 3}'),
    "speculative_decoding a string": _vllm_answer('"fast"'),
    "negative step count": _vllm_answer('{"mean_acceptance_length": 2.0, "num_spec_steps": -3}'),
    "metrics a list": b'{"choices": [], "metrics": [1]}',
}
BAD_COUNTERS = {
    "NaN": "vllm:spec_decode_num_drafts_total NaN\nvllm:spec_decode_num_accepted_tokens_total 3\n",
    "+Inf": "vllm:spec_decode_num_drafts_total 4\nvllm:spec_decode_num_accepted_tokens_total +Inf\n",
    "-5": "vllm:spec_decode_num_drafts_total -5\nvllm:spec_decode_num_accepted_tokens_total 3\n",
    "not a number": "vllm:spec_decode_num_drafts_total 4\nvllm:spec_decode_num_accepted_tokens_total abc\n",
}


def _serve(**kwargs) -> FakeEngine:
    srv = FakeEngine(kwargs.pop("flavour", "sglang"), **kwargs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _stop(srv: FakeEngine) -> None:
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("case", list(BAD_SGLANG))
def test_a_bad_sglang_answer_is_a_server_error_naming_the_url(case):
    srv = _serve(raw=BAD_SGLANG[case])
    try:
        with pytest.raises(ServerError, match=rf"{srv.url}/generate: "):
            server_tau(srv.url, "sglang", PROMPTS[:2], MAX_NEW, BLOCK, max_retries=0, timeout_s=5)
    finally:
        _stop(srv)


@pytest.mark.parametrize("case", list(BAD_VLLM))
def test_a_bad_vllm_answer_is_a_server_error_naming_the_url(case):
    srv = _serve(flavour="vllm_per_request", raw=BAD_VLLM[case])
    try:
        with pytest.raises(ServerError, match=rf"{srv.url}/v1/completions: "):
            server_tau(srv.url, "vllm", PROMPTS[:2], MAX_NEW, BLOCK, model="served", max_retries=0, timeout_s=5)
    finally:
        _stop(srv)


@pytest.mark.parametrize("case", list(BAD_COUNTERS))
def test_bad_prometheus_counters_are_a_server_error(case):
    from dflash_dist.evaluator.server import vllm_counters

    srv = _serve(flavour="vllm_prometheus", raw=BAD_COUNTERS[case].encode())
    try:
        with pytest.raises(ServerError, match=rf"{srv.url}/metrics: vllm:spec_decode_num_\w+ = "):
            vllm_counters(srv.url, timeout_s=5, retries=0)
    finally:
        _stop(srv)


def test_a_good_answer_at_the_bounds_is_accepted():
    """The checks refuse only what cannot be: 1 and the block size (vLLM), block + 1/verifies (SGLang)."""
    for raw, engine, tau in ((_vllm_answer('{"mean_acceptance_length": 16}'), "vllm", 16.0),
                             (_vllm_answer('{"mean_acceptance_length": 1}'), "vllm", 1.0),
                             (_sglang_answer("16.5"), "sglang", 16.5)):  # 33 tokens in 2 verifies + the prefill's
        srv = _serve(flavour="vllm_per_request" if engine == "vllm" else "sglang",
                     raw=raw.replace(b'"completion_tokens": 7', b'"completion_tokens": 33'))
        try:
            assert server_tau(srv.url, engine, PROMPTS[:2], MAX_NEW, BLOCK, model="served", max_retries=0,
                              timeout_s=5).tau == tau
        finally:
            _stop(srv)


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "close-delimited"])
def test_an_oversized_answer_is_refused_without_reading_it_whole(declare):
    from dflash_dist.evaluator.server import MAX_BODY_BYTES

    huge = 200 * 1024 * 1024  # far more than socket buffers hold: the server sees the client hang up
    srv = _serve(huge=huge, declare=declare)
    try:
        with pytest.raises(ServerError, match=rf"{srv.url}/generate: answer .*over the {MAX_BODY_BYTES}-byte limit"):
            server_tau(srv.url, "sglang", PROMPTS[:1], MAX_NEW, BLOCK, max_retries=0, timeout_s=10)
    finally:
        _stop(srv)
    deadline = time.monotonic() + 10
    while srv.sending and time.monotonic() < deadline:  # the handler notices the hang-up
        time.sleep(0.05)
    assert srv.sent < huge // 4  # the client hung up instead of taking it all


def test_eval_mode_settings_are_checked_at_load():
    from dflash_dist.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.server_url is required"):
        load_config("configs/tiny.yaml", ["eval.mode=server"])
    with pytest.raises(ConfigError, match="eval.server_url .* must start with http"):
        load_config("configs/tiny.yaml", ["eval.mode=server", "eval.server_url=127.0.0.1:30000"])
    with pytest.raises(ConfigError, match="eval.mode: 'fast' is not one of"):
        load_config("configs/tiny.yaml", ["eval.mode=fast"])
    with pytest.raises(ConfigError, match="eval.live_every must be >= 1"):
        load_config("configs/tiny.yaml", ["eval.live_every=0"])
    with pytest.raises(ConfigError, match="eval.count: 'all' is not one of"):
        load_config("configs/tiny.yaml", ["eval.count=all"])
    with pytest.raises(ConfigError, match="eval.reference_drafter: .*config.json not found"):
        load_config("configs/tiny.yaml", ["eval.reference_drafter=/nonexistent"])
    cfg = load_config("configs/tiny.yaml", ["eval.mode=server", "eval.server_url=http://127.0.0.1:8000",
                                            "eval.server_engine=vllm"])
    assert cfg.eval.mode == "server" and cfg.eval.count == "capped" and cfg.eval.live_every == 1
