"""tau as the serving engine counts it: the held-out prompts sent to an SGLang or vLLM endpoint
that serves the exported drafter, and the engine's own accept length read back.

Formats followed (the test's loopback server answers in exactly these):
- SGLang (python/sglang/srt/managers/tokenizer_manager.py, `_calculate_spec_decoding_metrics`, at
  commit c60799d0): POST /generate {"input_ids", "sampling_params"} answers
  {"text", "output_ids", "meta_info": {"completion_tokens", "spec_verify_ct", "spec_accept_length",
  ...}} with spec_accept_length = completion_tokens / spec_verify_ct (bonus token included).
- vLLM (docs v0.32.0, features/speculative_decoding/acceptance_metrics): started with
  `--per-request-spec-decode-metrics summary|detailed`, POST /v1/completions answers a top-level
  {"metrics": {"speculative_decoding": {"mean_acceptance_length", "num_spec_steps",
  "num_accepted_draft_tokens", "num_draft_tokens", ...}}}, mean_acceptance_length =
  1 + num_accepted_draft_tokens / num_spec_steps. Without that flag the response has no such
  field and tau comes from the deltas of the Prometheus counters on /metrics,
  `vllm:spec_decode_num_drafts` and `vllm:spec_decode_num_accepted_tokens` (exposed with the
  `_total` suffix): 1 + accepted / drafts over all the requests (a token-weighted mean, not the
  per-prompt mean; the record says which).

Requests go out greedy (temperature 0), `eval.server_concurrency` at a time, each retried on a
5xx, 429, timeout or lost connection with exponential backoff. Plain urllib: no client library.

The server is not trusted: a body is read up to MAX_BODY_BYTES, JSON with NaN/Infinity is
refused, and every field is parsed into a typed value before use: counts are non-negative
integers, accept lengths finite and within [1, block_size] (SGLang's count includes the token the
prefill produced, so its bound is block_size + 1/spec_verify_ct). Anything else is a ServerError
naming the URL and the field.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENGINES = ("sglang", "vllm")
_RETRY_STATUS = {429, 500, 502, 503, 504}
MAX_BODY_BYTES = 4 * 1024 * 1024  # an answer (or /metrics page) larger than this is refused, not read whole
_COUNTER_RE = re.compile(r"^(vllm:spec_decode_num_(?:drafts|accepted_tokens))(?:_total)?(?:\{[^}]*\})?\s+(\S+)$")


class ServerError(RuntimeError):
    """The endpoint failed or answered without the fields this engine's format promises."""


@dataclass(frozen=True)
class ServerResult:
    """The engine's tau over the prompts: `tau` = mean over prompts of each request's accept
    length (source "per_request"), or 1 + accepted/drafts from the counters (source "prometheus")."""

    engine: str
    tau: float
    per_prompt: tuple[float, ...]
    source: str
    requests: int

    def to_json(self) -> dict:
        return {"engine": self.engine, "tau": self.tau, "per_prompt": list(self.per_prompt), "source": self.source,
                "requests": self.requests}

    @classmethod
    def from_json(cls, d: dict) -> ServerResult:
        return cls(str(d["engine"]), float(d["tau"]), tuple(float(x) for x in d["per_prompt"]), str(d["source"]),
                   int(d["requests"]))


def _read_capped(resp, url: str) -> bytes:
    """The body, refused when longer than MAX_BODY_BYTES (by its Content-Length or as read)."""
    declared = resp.headers.get("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ServerError(f"{url}: answer of {int(declared)} bytes is over the {MAX_BODY_BYTES}-byte limit")
    body = resp.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        raise ServerError(f"{url}: answer is over the {MAX_BODY_BYTES}-byte limit (not read further)")
    return body


def _request(url: str, body: dict | None, timeout_s: float, max_retries: int) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    for attempt in range(max_retries + 1):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers),
                                        timeout=timeout_s) as resp:
                return _read_capped(resp, url)
        except urllib.error.HTTPError as e:
            if e.code not in _RETRY_STATUS or attempt == max_retries:
                raise ServerError(f"{url}: HTTP {e.code}: {e.read(300)!r}") from None
            reason = f"HTTP {e.code}"
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # refused, reset, cut short, timeout
            if attempt == max_retries:
                raise ServerError(f"{url}: {e} (after {max_retries + 1} attempts)") from None
            reason = str(e)
        delay = min(0.25 * 2**attempt, 8.0)
        log.warning("server eval: %s failed (%s), retry %d/%d in %.2fs", url, reason, attempt + 1, max_retries, delay)
        time.sleep(delay)
    raise AssertionError("unreachable")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _json(raw: bytes, url: str) -> dict:
    """The answer as a JSON object; NaN/Infinity (which Python's json accepts) are refused."""
    try:
        out = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ServerError(f"{url}: the answer is not valid JSON ({e}): {raw[:300]!r}") from None
    if not isinstance(out, dict):
        raise ServerError(f"{url}: the answer is a JSON {type(out).__name__}, not an object: {raw[:300]!r}")
    return out


def _count(value, url: str, field: str) -> int:
    """A non-negative integer count (an integral float such as 12.0 counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < 0:
        raise ServerError(f"{url}: {field} = {value!r} is not a non-negative integer count")
    return int(value)


def _accept_length(value, url: str, field: str, high: float) -> float:
    """An accept length: a finite number in [1, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 1.0 <= value <= high:
        raise ServerError(f"{url}: {field} = {value!r} is not an accept length in [1, {high:g}] (is the server "
                          "serving this drafter, with its block size?)")
    return float(value)


def _sglang_accept_length(url: str, prompt: list[int], max_new_tokens: int, block_size: int, timeout_s: float,
                          retries: int) -> float:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    where = f"{url}/generate"
    out = _json(_request(where, body, timeout_s, retries), where)
    meta = out.get("meta_info")
    if not isinstance(meta, dict) or meta.get("spec_accept_length") is None:
        raise ServerError(f"{where}: no meta_info.spec_accept_length in the answer (is the server started "
                          f"with --speculative-algorithm DFLASH?): {str(out)[:300]}")
    high = float(block_size)
    if "spec_verify_ct" in meta:  # the prefill's token is in completion_tokens but in no verify
        verify_ct = _count(meta["spec_verify_ct"], where, "meta_info.spec_verify_ct")
        if verify_ct == 0:
            raise ServerError(f"{where}: meta_info.spec_verify_ct = 0 with a spec_accept_length: no verify ran")
        high += 1.0 / verify_ct
        if "completion_tokens" in meta:
            completion = _count(meta["completion_tokens"], where, "meta_info.completion_tokens")
            if completion > block_size * verify_ct + 1:
                raise ServerError(f"{where}: meta_info.completion_tokens = {completion} is more than "
                                  f"{verify_ct} verifies of block size {block_size} can produce")
    return _accept_length(meta["spec_accept_length"], where, "meta_info.spec_accept_length", high)


def _vllm_accept_length(url: str, model: str | None, prompt: list[int], max_new_tokens: int, block_size: int,
                        timeout_s: float, retries: int) -> float | None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0}
    where = f"{url}/v1/completions"
    out = _json(_request(where, body, timeout_s, retries), where)
    if "choices" not in out:
        raise ServerError(f"{where}: not a completion: {str(out)[:300]}")
    metrics = out.get("metrics")
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise ServerError(f"{where}: metrics is a {type(metrics).__name__}, not an object")
    spec = metrics.get("speculative_decoding")
    if spec is None:
        return None
    if not isinstance(spec, dict) or "mean_acceptance_length" not in spec:
        raise ServerError(f"{where}: metrics.speculative_decoding has no mean_acceptance_length: {str(spec)[:300]}")
    for field in ("num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens"):
        if field in spec:
            _count(spec[field], where, f"metrics.speculative_decoding.{field}")
    return _accept_length(spec["mean_acceptance_length"], where, "metrics.speculative_decoding.mean_acceptance_length",
                          float(block_size))


def vllm_counters(url: str, timeout_s: float = 30.0, retries: int = 3) -> dict[str, float]:
    """The two spec-decode counters from vLLM's Prometheus text, summed over label sets."""
    where = f"{url}/metrics"
    text = _request(where, None, timeout_s, retries).decode("utf-8", errors="replace")
    counters = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
    seen = set()
    for line in text.splitlines():
        m = _COUNTER_RE.match(line.strip())
        if m:
            try:
                value = float(m.group(2))
            except ValueError:
                raise ServerError(f"{where}: {m.group(1)} = {m.group(2)!r} is not a number") from None
            counters[m.group(1)] += _count(value, where, m.group(1))
            seen.add(m.group(1))
    if len(seen) < 2:
        raise ServerError(f"{url}/metrics has no vllm:spec_decode_num_drafts/num_accepted_tokens counters "
                          "(is speculative decoding on?)")
    return counters


def server_tau(url: str, engine: str, prompts: list[list[int]], max_new_tokens: int, block_size: int,
               model: str | None = None, concurrency: int = 4, max_retries: int = 3,
               timeout_s: float = 300.0) -> ServerResult:
    """Send every prompt (token ids) greedily to the engine at `url`; its tau (module docstring).
    `block_size` is the served drafter's: no accept length may exceed it."""
    if engine not in ENGINES:
        raise ValueError(f"eval.server_engine must be one of {ENGINES}, got {engine!r}")
    if block_size < 1:
        raise ValueError(f"server_tau: block_size must be >= 1, got {block_size}")
    url = url.rstrip("/").removesuffix("/v1")
    before = None
    if engine == "sglang":
        def one(p: list[int]) -> float | None:
            return _sglang_accept_length(url, p, max_new_tokens, block_size, timeout_s, max_retries)
    else:
        def one(p: list[int]) -> float | None:
            return _vllm_accept_length(url, model, p, max_new_tokens, block_size, timeout_s, max_retries)
        try:
            before = vllm_counters(url, timeout_s, max_retries)
        except ServerError:
            before = None  # no counters: the per-request metrics must be there
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="server-eval") as pool:
        lengths = list(pool.map(one, prompts))
    if all(x is not None for x in lengths):
        per_prompt = tuple(float(x) for x in lengths)
        return ServerResult(engine, sum(per_prompt) / len(per_prompt), per_prompt, "per_request", len(prompts))
    if before is None:
        raise ServerError(f"{url}: vLLM answered without metrics.speculative_decoding and its /metrics has no "
                          "spec-decode counters: start it with --per-request-spec-decode-metrics summary")
    after = vllm_counters(url, timeout_s, max_retries)
    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    if drafts <= 0:
        raise ServerError(f"{url}/metrics: vllm:spec_decode_num_drafts did not grow over {len(prompts)} requests")
    tau = _accept_length(1.0 + accepted / drafts, f"{url}/metrics", "1 + accepted / drafts (counter deltas)",
                         float(block_size))
    return ServerResult(engine, tau, (), "prometheus", len(prompts))
