"""A vLLM server as a token-exact policy: inference in its own process (or machine), reached over HTTP.

:class:`VLLMServerPolicy` samples from vLLM's own OpenAI-compatible server (``vllm serve``): started
by the policy on this machine, or given by URL. Unlike :class:`~toolgym.agents.http_policy.HTTPPolicy`
(any chat API, text only), it is **token-exact**, so the trainer can train on what it samples:

* **Tokens in, tokens out.** The rollout's token ids go to ``/v1/completions`` as the prompt
  (``prompt`` is a list of ids, never re-tokenised); the reply's ``token_ids`` (``return_token_ids``)
  and each sampled token's logprob (``logprobs = 0``) are the completion. The sampling settings, the
  end-of-turn stop ids and ``processed_logprobs`` are those of the in-process
  :class:`~toolgym.agents.vllm_policy.VLLMPolicy`, so on the same model the two agree token for
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
* **Checked at start.** A URL that is not a vLLM server (no ``/version`` with a version, no
  ``/v1/models``), or one that serves another model than ``model``, is a
  :class:`~toolgym.errors.ConfigError` naming what it found; a started server that exits before it
  is ready is one too, with the end of its log.
* **Failures.** A server that stops answering (connection refused or reset, timeouts, HTTP 5xx) is a
  :class:`~toolgym.errors.PolicyError`: the rollout makes the episode ``infra_error`` and a training
  run stops after ``max_infra_groups`` such groups, as with the in-process engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolgym.agents.hf_tokenizer import HFTokenizer, chat_tokenizer
from toolgym.agents.models import resolve_model_dir
from toolgym.agents.policy import ChatPolicy
from toolgym.agents.vllm_policy import CPU_BATCHED_TOKENS, CPU_BLOCK_SIZE, GiB, check_prompt, completion_text
from toolgym.agents.vllm_weights import check_weights_file
from toolgym.core import Completion, SamplingParams
from toolgym.errors import ConfigError, MissingDependencyError, PolicyError
from toolgym.procs import free_port, log_tail

__all__ = ["VLLMServerPolicy"]

logger = logging.getLogger(__name__)

_EXTENSION = "toolgym.agents.vllm_weights.WeightLoaderExtension"
_SERVED_NAME = "toolgym-policy"


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
            :class:`~toolgym.agents.vllm_policy.VLLMPolicy` (CPU block size 32, whole-prompt prefill).
        server_args: further ``vllm serve`` arguments for the started server.
        chat_format, thinking_budget: as for the other policies.
        start_timeout_s: how long a started server may take to answer ``/health``.
        timeout_s: the deadline of one request.
        log_path: where the started server's output goes (default a temporary file, named in errors).
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
    ) -> None:
        self._http = _httpx()
        self.model_dir = resolve_model_dir(model)
        self.timeout_s = timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        if url is None:
            self.url = self._start(
                dtype, max_model_len, seed, kv_cache_gib, cpu_reserved, server_args, log_path
            )
            self._wait_ready(start_timeout_s)
        else:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"the vLLM server URL must start with http:// or https://, got {url!r}")
            self.url = url.rstrip("/")
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
            "--enable-prefix-caching",
        ]  # fmt: skip
        if on_cpu:  # the in-process engine's CPU settings (agents/vllm_policy.py says why)
            args += ["--enforce-eager", "--block-size", str(CPU_BLOCK_SIZE), "--no-enable-chunked-prefill"]
            args += ["--max-num-batched-tokens", str(max(CPU_BATCHED_TOKENS, max_model_len))]
        if kv_cache_gib is not None or on_cpu:
            args += ["--kv-cache-memory-bytes", str(int((kv_cache_gib or 1.0) * GiB))]
        args += list(server_args)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        if cpu_reserved is not None and on_cpu:
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cpu_reserved))
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="toolgym-vllm-server-", suffix=".log")
            os.close(handle)
            log_path = name
        self.log_path = Path(log_path)
        with open(self.log_path, "wb") as out:
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
                if self._http.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    self.start_seconds = time.perf_counter() - start
                    return
            except self._http.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise ConfigError(
                    f"the vLLM server did not answer /health within {timeout_s:.0f} s{self._log_tail()}"
                )
            time.sleep(0.5)

    def _log_tail(self) -> str:
        return log_tail(self.log_path, 10)

    def _check_server(self) -> tuple[str, int, str]:
        """The served model's name and length, and vLLM's version, after checking it is the model asked for."""
        http = self._http
        try:
            version = http.get(f"{self.url}/version", timeout=30.0)
            models = http.get(f"{self.url}/v1/models", timeout=30.0)
        except http.TransportError as exc:
            raise ConfigError(f"no server answers at {self.url} ({type(exc).__name__}: {exc})") from exc
        try:
            vllm_version = str(version.json()["version"])
            served = models.json()["data"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ConfigError(
                f"{self.url} is not a vLLM server: GET /version answered HTTP {version.status_code} "
                f"{version.text[:120]!r}, GET /v1/models HTTP {models.status_code} {models.text[:120]!r}"
            ) from None
        root = str(served.get("root") or served.get("id"))
        if Path(root).resolve() != Path(self.model_dir).resolve():
            raise ConfigError(
                f"{self.url} serves {root!r} (as {served.get('id')!r}), not {str(self.model_dir)!r}: start the "
                "server with this model, or set policy.model to what it serves"
            )
        return str(served["id"]), int(served.get("max_model_len") or 0), vllm_version

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

    async def _post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        try:
            response = await self._async_client().post(f"{self.url}{path}", json=body, params=params or None)
        except self._http.TransportError as exc:
            raise self._unreachable(path, exc) from exc
        return self._reply(path, response)

    def _post_sync(self, client: Any, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        try:
            response = client.post(f"{self.url}{path}", json=body, params=params or None)
        except self._http.TransportError as exc:
            raise self._unreachable(path, exc) from exc
        return self._reply(path, response)

    def _unreachable(self, path: str, exc: BaseException) -> PolicyError:
        return PolicyError(
            f"the vLLM server at {self.url} did not answer {path} ({type(exc).__name__}: {exc})"
        )

    def _reply(self, path: str, response: Any) -> Any:
        """A reply's JSON; HTTP 5xx is the server's failure (``PolicyError``), 4xx a refused request."""
        if response.status_code >= 500:
            raise PolicyError(
                f"the vLLM server at {self.url} failed {path}: HTTP {response.status_code} {response.text[:300]}"
            )
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
        data = await self._post("/v1/completions", self.request_body(prompt, sampling))
        try:
            choice = data["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            finish = choice["finish_reason"]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(
                f"the vLLM server answered without a token completion: {str(data)[:300]}"
            ) from exc
        if finish not in ("stop", "length"):
            raise PolicyError(f"the vLLM server ended the request with finish_reason={finish!r}")
        if len(logprobs) != len(ids):
            raise PolicyError("the vLLM server returned no logprob for some sampled token")
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
            return [float(step[str(t)]["logprob"]) for step, t in zip(steps[1:], prompt[1:], strict=True)]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(f"the vLLM server returned no prompt logprobs: {str(data)[:300]}") from exc

    # ----------------------------------------------------------------- weights
    def _load(self, path: str) -> dict[str, float]:
        with self._http.Client(timeout=self.timeout_s) as client:
            self._post_sync(client, "/pause", mode="keep")
            try:
                rpc = {"method": "toolgym_load_weights", "args": [path]}
                reply = self._post_sync(client, "/collective_rpc", rpc)
                self._post_sync(client, "/reset_prefix_cache")
            finally:
                self._post_sync(client, "/resume")
        try:
            return {k: float(v) for k, v in reply["results"][0].items()}
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise PolicyError(f"the vLLM server's weight reload answered {str(reply)[:200]}") from exc

    def load_weights(self, path: str | Path, version: int) -> dict[str, float]:
        """Reload the served weights from a safetensors file the server can read, and label them
        ``version`` (blocking; from async code through ``asyncio.to_thread``). Returns ``{"tensors", "seconds"}``."""
        path = Path(path)
        check_weights_file(path, self.model_dir, self.policy_version, version)
        result = self._load(str(path))
        self.policy_version = int(version)
        logger.info("vLLM server weights v%d loaded in %.2f s", version, result.get("seconds", 0.0))
        return result


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
