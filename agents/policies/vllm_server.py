"""A vLLM server as a token-exact policy: inference in its own process (or machine), reached over HTTP.

:class:`VLLMServerPolicy` samples from vLLM's own OpenAI-compatible server (``vllm serve``): started
by the policy on this machine, or given by URL. Unlike :class:`~toolgym.agents.policies.http.HTTPPolicy`
(any chat API, text only), it is **token-exact**, so the trainer can train on what it samples:

* **Tokens in, tokens out.** The rollout's token ids go to ``/v1/completions`` as the prompt
  (``prompt`` is a list of ids, never re-tokenised); the reply's ``token_ids`` (``return_token_ids``)
  and each sampled token's logprob (``logprobs = 0``) are the completion. The sampling settings, the
  end-of-turn stop ids and ``processed_logprobs`` are those of the in-process
  :class:`~toolgym.agents.policies.vllm.VLLMPolicy`, so on the same model the two agree token for
  token (a test checks greedy decoding). Prefix caching is on.
* **Weights pushed in place.** :meth:`VLLMServerPolicy.load_weights` takes the same safetensors file
  as the in-process engine (:class:`~toolgym.training.weight_sync.VLLMWeightSync` writes it) and runs
  ``/pause`` (in-flight requests frozen), the worker extension's ``toolgym_load_weights`` through
  ``/collective_rpc`` (vLLM's development endpoints: the started server sets
  ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls``; a server given by URL must have both),
  ``/reset_prefix_cache`` and ``/resume``. The file must be readable by the server: the same machine,
  or a shared directory (``policy.weights_dir``). On GPUs a collective transfer would replace the file; the
  ``load_weights(path, version)`` contract stays.
* **Versions.** The server does not label completions, so the policy does: a completion reports the
  version served when its request was sent, and the older one if a reload finished meanwhile (a
  conservative age for ``max_off_policy_steps``, as the in-process engine's).
* **Access.** A started server listens on 127.0.0.1 only, with a fresh key per start
  (``secrets.token_urlsafe``) that every request carries as ``Authorization: Bearer``.
  vLLM's own ``--api-key`` checks only ``/v1`` and a few other prefixes, not the development routes
  that reload the weights or pause sampling, so the server also loads
  :class:`~toolgym.agents.policies.vllm_guard.KeyGuard` (``--middleware``): every route needs the key, and a
  request with an ``Origin`` header (a web page's) is refused. The key reaches the server in its
  environment (``VLLM_API_KEY``), never its command line, which every user of the machine can read. A
  server given by URL gets the key from the environment variable ``api_key_env`` names
  (``policy.api_key_env``; the key itself is never in a config); one that answers 401 is a
  :class:`~toolgym.errors.ConfigError` naming that setting, and one whose development routes answer
  without a key is named in a warning (start it with the guard: ``training/README.md``).
* **Replies are not trusted.** Each reply must arrive whole within ``timeout_s`` (a total deadline,
  not one per read: a dripping server times out) and within ``max_reply_bytes`` (read in chunks,
  never whole; :func:`~toolgym.agents.policies.http.read_reply`); a completion must hold at most the
  requested ``max_tokens`` token ids, each an integer in ``[0, vocab)`` (the model's output rows,
  ``config.json``'s ``vocab_size``), and as many logprobs, each finite and ``<= 0``
  (:func:`checked_completion`). Anything else is a :class:`~toolgym.errors.PolicyError`: the
  episode becomes ``infra_error`` and is never trained on.
* **Checked at start.** A URL that is not a vLLM server (no ``/version`` with a version, no
  ``/v1/models``), or one that serves another model than ``model``, is a
  :class:`~toolgym.errors.ConfigError` naming what it found; a started server that exits before it
  is ready is one too, with the end of its log.
* **Failures.** A server that stops answering (connection refused or reset, timeouts, HTTP 5xx) or
  answers outside the rules above is a :class:`~toolgym.errors.PolicyError`: the rollout makes the episode ``infra_error`` and a training
  run stops after ``max_infra_groups`` such groups, as with the in-process engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from toolgym.agents.policies.base import ChatPolicy
from toolgym.agents.policies.hf_tokenizer import HFTokenizer, chat_tokenizer
from toolgym.agents.policies.http import MAX_REPLY_BYTES, Reply, read_reply
from toolgym.agents.policies.spec import resolve_model_dir
from toolgym.agents.policies.vllm import (
    CPU_BATCHED_TOKENS,
    CPU_BLOCK_SIZE,
    GiB,
    check_prompt,
    completion_text,
)
from toolgym.agents.policies.vllm_guard import KEY_ENV
from toolgym.agents.policies.vllm_weights import check_weights_file
from toolgym.core import Completion, SamplingParams
from toolgym.errors import ConfigError, MissingDependencyError, PolicyError
from toolgym.procs import free_port, log_tail
from toolgym.run_files import create_new

__all__ = ["LOGPROB_SLACK", "VLLMServerPolicy", "checked_completion", "checked_logprobs"]

logger = logging.getLogger(__name__)

_EXTENSION = "toolgym.agents.policies.vllm_weights.WeightLoaderExtension"
_GUARD = "toolgym.agents.policies.vllm_guard.KeyGuard"
_SERVED_NAME = "toolgym-policy"
#: How far above 0 a served logprob may lie and still count as 0 (it is recorded as 0). A log-softmax
#: computed as ``logit - logsumexp`` in float32 can round the top token's logprob a few ulps above 0
#: (the sum's rounding, a fused kernel's summation order): 1e-6 is a hundred times that and a
#: probability ratio of 1.000001, nothing a trainer could be steered by; a real positive logprob is
#: larger by orders of magnitude.
LOGPROB_SLACK = 1e-6

_T = TypeVar("_T")


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise MissingDependencyError("httpx", "http", "VLLMServerPolicy") from exc
    return httpx


class VLLMServerPolicy(ChatPolicy):
    """Sampling from a vLLM server, token-exact (see the module docstring).

    Args:
        model: the checkpoint: ``None`` for the embedded SmolLM2, or a local model directory (its
            tokenizer renders the chat here; a server given by ``url`` must serve this directory).
        url: a running server's base URL (``http://host:port``); ``None`` starts one on this machine.
        dtype, max_model_len, seed, kv_cache_gib, cpu_reserved: the started server's settings, as for
            :class:`~toolgym.agents.policies.vllm.VLLMPolicy` (CPU block size 32, whole-prompt prefill).
        server_args: further ``vllm serve`` arguments for the started server.
        chat_format, thinking_budget: as for the other policies.
        start_timeout_s: how long a started server may take to answer ``/health``.
        timeout_s: the deadline of one request, its whole reply read.
        log_path: where the started server's output goes (default a temporary file, named in errors).
        api_key_env: for a server given by ``url``: the environment variable that holds its key (sent
            as a bearer token; unset or empty = none). A started server gets a fresh key of its own.
        max_reply_bytes: the largest reply read; a larger one is a ``PolicyError``.
    """

    name = "vllm-server"
    token_exact = True

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        url: str | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        seed: int = 0,
        kv_cache_gib: float | None = None,
        cpu_reserved: int | None = None,
        server_args: Sequence[str] = (),
        chat_format: str = "auto",
        thinking_budget: int | None = None,
        start_timeout_s: float = 600.0,
        timeout_s: float = 600.0,
        log_path: str | Path | None = None,
        api_key_env: str = KEY_ENV,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self._http = _httpx()
        self.model_dir = resolve_model_dir(model)
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.api_key_env = api_key_env
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        if url is None:
            #: the key every request carries (a started server's own; from ``api_key_env`` for a URL)
            self.api_key: str | None = secrets.token_urlsafe(32)
            self.url = self._start(
                dtype, max_model_len, seed, kv_cache_gib, cpu_reserved, server_args, log_path
            )
            self._wait_ready(start_timeout_s)
        else:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"the vLLM server URL must start with http:// or https://, got {url!r}")
            self.url = url.rstrip("/")
            self.api_key = os.environ.get(api_key_env) or None
        try:
            self.served_name, self.max_model_len, self.server_version = self._check_server()
        except BaseException:
            self.close()
            raise
        tokenizer, fmt = chat_tokenizer(self.model_dir, chat_format, thinking_budget)
        super().__init__(tokenizer, chat_format=fmt)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.stop_ids = self.tokenizer.stop_ids
        self.vocab_size = len(self.tokenizer)
        #: the ids the model can sample: its output layer's rows (a reply's ids must lie below)
        self.model_vocab_size = _model_vocab_size(self.model_dir, self.vocab_size)
        self.policy_version = 0
        self._client: Any = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    tokenizer: HFTokenizer

    # ----------------------------------------------------------------- the server
    def _start(
        self,
        dtype: str,
        max_model_len: int,
        seed: int,
        kv_cache_gib: float | None,
        cpu_reserved: int | None,
        server_args: Sequence[str],
        log_path: str | Path | None,
    ) -> str:
        port = free_port()
        on_cpu = not _cuda_available()
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", _SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", _EXTENSION,
            "--enable-prefix-caching", "--middleware", _GUARD,
        ]  # fmt: skip
        if on_cpu:  # the in-process engine's CPU settings (agents/policies/vllm.py says why)
            args += ["--enforce-eager", "--block-size", str(CPU_BLOCK_SIZE), "--no-enable-chunked-prefill"]
            args += ["--max-num-batched-tokens", str(max(CPU_BATCHED_TOKENS, max_model_len))]
        if kv_cache_gib is not None or on_cpu:
            args += ["--kv-cache-memory-bytes", str(int((kv_cache_gib or 1.0) * GiB))]
        args += list(server_args)
        # NOTE (access): the key goes in the environment, readable only by this user, not on the
        # command line (``ps``); the guard checks it on every route, vLLM's own check on /v1 again.
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **{KEY_ENV: self.api_key or ""})
        if cpu_reserved is not None and on_cpu:
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cpu_reserved))
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="toolgym-vllm-server-", suffix=".log")
            os.close(handle)
            log_path = name
        self.log_path = Path(log_path)
        with create_new(self.log_path) as out:  # a log in a run directory: never through a planted link
            # its own process group: the engine core and workers it spawns go with it on close()
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        logger.info("starting a vLLM server for %s on port %d (log: %s)", self.model_dir, port, self.log_path)
        return f"http://127.0.0.1:{port}"

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        start = time.perf_counter()
        while True:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                self.close()  # whatever it spawned goes too
                raise ConfigError(f"the vLLM server exited ({code}) before it was ready{self._log_tail()}")
            try:
                if _blocking(self._get("/health", timeout_s=5.0)).status_code == 200:
                    self.start_seconds = time.perf_counter() - start
                    return
            except (self._http.TransportError, TimeoutError, PolicyError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise ConfigError(
                    f"the vLLM server did not answer /health within {timeout_s:.0f} s{self._log_tail()}"
                )
            time.sleep(0.5)

    def _log_tail(self) -> str:
        return log_tail(self.log_path, 10)

    def _headers(self, keyed: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if keyed and self.api_key else {}

    async def _get(self, path: str, *, timeout_s: float, keyed: bool = True) -> Reply:
        async with self._http.AsyncClient(timeout=timeout_s) as client:
            return await read_reply(
                client,
                "GET",
                f"{self.url}{path}",
                timeout_s=timeout_s,
                max_bytes=self.max_reply_bytes,
                headers=self._headers(keyed),
            )

    def _check_server(self) -> tuple[str, int, str]:
        """The served model's name and length, and vLLM's version, after checking it is the model asked for."""
        http = self._http
        try:
            version = _blocking(self._get("/version", timeout_s=30.0))
            models = _blocking(self._get("/v1/models", timeout_s=30.0))
        except (http.TransportError, TimeoutError, PolicyError) as exc:
            raise ConfigError(
                f"no server answers at {self.url} ({type(exc).__name__}: {str(exc) or 'no reply within 30 s'})"
            ) from exc
        if 401 in (version.status_code, models.status_code):
            raise self._key_refused()
        try:
            vllm_version = str(version.json()["version"])
            served = models.json()["data"][0]
            root = str(served.get("root") or served.get("id"))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise ConfigError(
                f"{self.url} is not a vLLM server: GET /version answered HTTP {version.status_code} "
                f"{version.text[:120]!r}, GET /v1/models HTTP {models.status_code} {models.text[:120]!r}"
            ) from None
        if Path(root).resolve() != Path(self.model_dir).resolve():
            raise ConfigError(
                f"{self.url} serves {root!r} (as {served.get('id')!r}), not {str(self.model_dir)!r}: start the "
                "server with this model, or set policy.model to what it serves"
            )
        if self.process is None:
            self._warn_if_open()
        try:
            return str(served["id"]), int(served.get("max_model_len") or 0), vllm_version
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{self.url} is not a vLLM server: GET /v1/models answered {models.text[:200]!r}"
            ) from None

    def _key_refused(self) -> ConfigError:
        """A server that wants a key this policy lacks (or another one): name the setting that gives it."""
        where = f"the environment variable {self.api_key_env} (named by policy.api_key_env)"
        if self.api_key is None:
            return ConfigError(
                f"the vLLM server at {self.url} requires an API key (HTTP 401) and none is set: put the key "
                f"it was started with in {where}"
            )
        return ConfigError(
            f"the vLLM server at {self.url} refused the API key in {where} (HTTP 401): set it to the key "
            "the server was started with"
        )

    def _warn_if_open(self) -> None:
        """Warn when a server given by URL answers a route outside ``/v1`` without a key: vLLM's own
        ``--api-key`` leaves those open, the development routes that replace the weights included."""
        with contextlib.suppress(self._http.TransportError, TimeoutError, PolicyError):
            if _blocking(self._get("/version", timeout_s=30.0, keyed=False)).status_code == 200:
                logger.warning(
                    "the vLLM server at %s answers without a key: anyone who can reach it can replace its "
                    "weights (/collective_rpc) or pause it. Start it with --middleware %s and its key in "
                    "%s, and give toolgym the key through policy.api_key_env",
                    self.url,
                    _GUARD,
                    KEY_ENV,
                )

    def close(self) -> None:
        """Stop the server this policy started, with the engine processes it spawned (its whole process
        group, even when the server itself already died); a server given by URL is left running.
        Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        _signal_group(process.pid, signal.SIGKILL)  # whatever of the group is left
        process.wait()

    def __enter__(self) -> VLLMServerPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- requests
    def _async_client(self) -> Any:
        """One connection pool per event loop (a client cannot cross loops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = self._http.AsyncClient(timeout=self.timeout_s)
            self._client_loop = loop
        return self._client

    async def _post(
        self, path: str, body: dict[str, Any] | None = None, *, client: Any = None, **params: Any
    ) -> Any:
        """POST ``path`` and return the reply's JSON: the whole reply within ``timeout_s`` and the size cap."""
        try:
            response = await read_reply(
                client or self._async_client(),
                "POST",
                f"{self.url}{path}",
                timeout_s=self.timeout_s,
                max_bytes=self.max_reply_bytes,
                json=body,
                params=params or None,
                headers=self._headers(),
            )
        except (self._http.TransportError, TimeoutError) as exc:
            raise self._unreachable(path, exc) from exc
        return self._reply(path, response)

    def _unreachable(self, path: str, exc: BaseException) -> PolicyError:
        what = str(exc) or f"no whole reply within {self.timeout_s:g} s"
        return PolicyError(
            f"the vLLM server at {self.url} did not answer {path} ({type(exc).__name__}: {what})"
        )

    def _reply(self, path: str, response: Reply) -> Any:
        """A reply's JSON; HTTP 5xx is the server's failure (``PolicyError``), 4xx a refused request."""
        if response.status_code >= 500:
            raise PolicyError(
                f"the vLLM server at {self.url} failed {path}: HTTP {response.status_code} {response.text[:300]}"
            )
        if response.status_code == 401:
            raise self._key_refused()
        if response.status_code >= 400:
            raise ConfigError(
                f"the vLLM server at {self.url} refused {path}: HTTP {response.status_code} {response.text[:500]}"
            )
        try:
            return response.json() if response.content else None
        except ValueError as exc:
            raise PolicyError(f"the vLLM server at {self.url} answered {path} with non-JSON") from exc

    def _check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        return check_prompt(token_ids, self.vocab_size, self.max_model_len)

    def request_body(self, prompt: list[int], sampling: SamplingParams) -> dict[str, Any]:
        """The ``/v1/completions`` request (the in-process engine's sampling settings)."""
        sampling.check()
        limit = self.max_model_len - len(prompt) if self.max_model_len else sampling.max_tokens
        body: dict[str, Any] = {
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": min(sampling.max_tokens, limit),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop_token_ids": list(self.stop_ids),
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        return body

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """Continue ``token_ids`` on the server; concurrent calls share its continuous batch."""
        prompt = self._check_prompt(token_ids)
        version = self.policy_version
        body = self.request_body(prompt, sampling)
        data = await self._post("/v1/completions", body)
        ids, logprobs, finish = checked_completion(
            data, vocab_size=self.model_vocab_size, max_tokens=body["max_tokens"]
        )
        text = completion_text(self.tokenizer, self.chat_format.stop_tokens, ids)
        return Completion(
            token_ids=tuple(ids),
            logprobs=tuple(logprobs),
            text=text,
            finish_reason=finish,
            policy_version=min(version, self.policy_version),
        )

    async def score(self, token_ids: Sequence[int]) -> list[float]:
        """Temperature-1 logprob of each token given the ones before it (``len(token_ids) - 1`` values),
        as the learner computes them: comparing the two checks that a weight sync reached the server."""
        prompt = self._check_prompt(token_ids)
        if len(prompt) < 2:
            raise ConfigError("score() needs at least two tokens")
        body = {
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        data = await self._post("/v1/completions", body)
        try:
            steps = data["choices"][0]["prompt_logprobs"]
            values = [step[str(t)]["logprob"] for step, t in zip(steps[1:], prompt[1:], strict=True)]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(f"the vLLM server returned no prompt logprobs: {str(data)[:300]}") from exc
        return checked_logprobs(values, "prompt logprob")

    # ----------------------------------------------------------------- weights
    async def _load(self, path: str) -> dict[str, float]:
        async with self._http.AsyncClient(timeout=self.timeout_s) as client:
            await self._post("/pause", client=client, mode="keep")
            try:
                rpc = {"method": "toolgym_load_weights", "args": [path]}
                reply = await self._post("/collective_rpc", rpc, client=client)
                await self._post("/reset_prefix_cache", client=client)
            finally:
                await self._post("/resume", client=client)
        try:
            return {k: float(v) for k, v in reply["results"][0].items()}
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            raise PolicyError(f"the vLLM server's weight reload answered {str(reply)[:200]}") from exc

    def load_weights(self, path: str | Path, version: int) -> dict[str, float]:
        """Reload the served weights from a safetensors file the server can read, and label them
        ``version`` (blocking; from async code through ``asyncio.to_thread``). Returns ``{"tensors", "seconds"}``."""
        path = Path(path)
        check_weights_file(path, self.model_dir, self.policy_version, version)
        result = _blocking(self._load(str(path)))
        self.policy_version = int(version)
        logger.info("vLLM server weights v%d loaded in %.2f s", version, result.get("seconds", 0.0))
        return result


def checked_completion(
    data: Any, *, vocab_size: int, max_tokens: int
) -> tuple[list[int], list[float], Literal["stop", "length"]]:
    """A ``/v1/completions`` reply's token ids, logprobs and finish reason, checked before anything uses them.

    A reply is trusted for nothing: at most ``max_tokens`` ids, each an integer in ``[0, vocab_size)``,
    one logprob per id (:func:`checked_logprobs`), and a finish reason of ``stop`` or ``length``.
    Anything else is a :class:`~toolgym.errors.PolicyError` saying what was wrong, so the episode is an
    ``infra_error`` and never reaches the learner (where an id past the vocabulary would index outside
    the embedding and a NaN or positive logprob would poison the importance ratio).
    """
    try:
        choice = data["choices"][0]
        raw_ids = choice["token_ids"]
        raw_logprobs = choice["logprobs"]["token_logprobs"]
        finish = choice["finish_reason"]
    except (KeyError, IndexError, TypeError) as exc:
        raise PolicyError(f"the vLLM server answered without a token completion: {str(data)[:300]}") from exc
    if not isinstance(raw_ids, list) or not isinstance(raw_logprobs, list):
        raise PolicyError(
            f"the vLLM server answered token ids or logprobs that are not lists: {str(choice)[:300]}"
        )
    if finish not in ("stop", "length"):
        raise PolicyError(f"the vLLM server ended the request with finish_reason={finish!r}")
    if len(raw_ids) > max_tokens:
        raise PolicyError(
            f"the vLLM server returned {len(raw_ids)} tokens for a request of max_tokens={max_tokens}"
        )
    for i, t in enumerate(raw_ids):
        if type(t) is not int:  # NOTE: bool is an int subclass; JSON true is no token id
            raise PolicyError(f"the vLLM server returned token id {t!r} at position {i}, not an integer")
        if not 0 <= t < vocab_size:
            raise PolicyError(
                f"the vLLM server returned token id {t} at position {i}, outside the vocabulary [0, {vocab_size})"
            )
    if len(raw_logprobs) != len(raw_ids):
        raise PolicyError(
            f"the vLLM server returned {len(raw_logprobs)} logprobs for {len(raw_ids)} sampled tokens"
        )
    return list(raw_ids), checked_logprobs(raw_logprobs, "logprob"), finish


def checked_logprobs(values: Sequence[Any], what: str) -> list[float]:
    """Served logprobs as floats, each finite and ``<= 0`` (up to :data:`LOGPROB_SLACK`, recorded as 0).

    Raises:
        PolicyError: a value that is not a number, not finite (NaN, infinities: JSON parsing accepts
            them) or positive, named with its position.
    """
    out: list[float] = []
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise PolicyError(f"the vLLM server returned {what} {x!r} at position {i}, not a number")
        value = float(x)
        if not math.isfinite(value) or value > LOGPROB_SLACK:
            raise PolicyError(
                f"the vLLM server returned {what} {value!r} at position {i}: a logprob is a finite number <= 0"
            )
        out.append(min(value, 0.0))
    return out


def _model_vocab_size(model_dir: Path, fallback: int) -> int:
    """The rows of the model's output layer (``config.json``'s ``vocab_size``, or its ``text_config``'s),
    else ``fallback`` (the tokenizer's length): the ids the model can sample and the learner can embed."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return fallback
    for table in (config, config.get("text_config") or {}):
        size = table.get("vocab_size") if isinstance(table, dict) else None
        if type(size) is int and size > 0:
            return size
    return fallback


def _blocking(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to its end from blocking code: on this thread, or, when this thread already runs an
    event loop (a caller in async code that did not use ``asyncio.to_thread``), on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
