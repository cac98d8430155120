"""A policy served by any OpenAI-compatible HTTP server (``vllm serve``, TGI, llama.cpp, hosted APIs).

For *evaluating* served models. The server owns the tokenizer and the chat template, so this policy
is text-level: it sends the conversation as chat messages and gets text (or OpenAI ``tool_calls``)
back. It cannot be token-exact, so its trajectories are for evaluation, never for training.

Decisions recorded here (each is part of the contract):

* **Token ids are UTF-8 bytes of JSON lines.** To satisfy the token-in/token-out
  :class:`~toolgym.core.Policy` protocol honestly, :meth:`HTTPPolicy.render` encodes each message as
  one JSON line (``{"role": ..., "content": ...}\\n``) and returns its UTF-8 bytes as ids 0-255; a
  completion's ids are the bytes of the assistant message's JSON line. The rollout's growing sequence
  is therefore a lossless JSON-lines transcript, which :meth:`HTTPPolicy.generate` decodes back into
  the message list it sends. ``len(token_ids)`` counts bytes, not model tokens: size an episode's
  ``max_total_tokens`` for bytes (about four per model token).
* **Logprobs are unknown** and recorded as 0.0; :attr:`HTTPPolicy.token_exact` is ``False`` so a
  trainer can refuse the policy. ``policy_version`` is always 0.
* **Tools.** The environment lists its tools in the system message (a ``<tools>`` block of JSON
  schemas). With ``send_tools=True`` those schemas are also sent as the request's ``tools``, so a
  server with a tool-call parser may answer with ``tool_calls``; each one is written back as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` text so the environment parses it like
  any model output (arguments that are not JSON are kept verbatim and become a parse error there).
  Tool results go to the server as user turns wrapped in ``<tool_response>`` tags, as in toolgym's
  own chat template (OpenAI ``tool`` messages would need call ids the text transcript does not have).
* **Chat format.** The server renders with the model's own template and parses its native tool calls
  (its tool-call parser); toolgym receives OpenAI messages. So the policy's
  :attr:`HTTPPolicy.chat_format` is ``hermes`` whatever the model: its calls reach the environment
  written as above, and reasoning a server separates (``reasoning_content``) never reaches it.
* **Failures.** Connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff
  (``backoff_s * 2**attempt``); when the retries run out the call raises
  :class:`~toolgym.errors.PolicyError` (an infrastructure error: the episode is ``infra_error``,
  never scored). So does an answer that is not a chat completion. Other 4xx answers are configuration mistakes (wrong model name, bad parameter) and
  raise :class:`~toolgym.errors.ConfigError` with the server's message, without retrying.
* **Replies are not trusted.** ``timeout_s`` is the deadline of a whole try (connecting, sending and
  reading every byte of the reply), not of each read: a server that drips its reply a byte at a time
  times out like one that says nothing. A reply is read in chunks and refused (``PolicyError``, not
  retried) as soon as it outgrows ``max_reply_bytes``, so an endless reply costs at most that much
  memory (:func:`read_reply`, which :class:`~toolgym.agents.policies.vllm_server.VLLMServerPolicy` shares). A
  reply whose ``usage.completion_tokens`` exceeds the request's ``max_tokens`` is refused too: the
  server did not honour the request. The completion's ids and logprobs are made here (bytes, 0.0),
  so there are none of the server's to check.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from toolgym.agents.chat.formats import ChatFormat, HermesFormat
from toolgym.agents.chat.messages import openai_messages, tool_schemas, turn_text
from toolgym.core import Completion, Message, SamplingParams
from toolgym.errors import ConfigError, MissingDependencyError, PolicyError

__all__ = [
    "MAX_REPLY_BYTES",
    "HTTPPolicy",
    "JsonLinesCodec",
    "Reply",
    "read_reply",
]

logger = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
#: The largest reply read by default: far above any completion's (a chat turn, a vLLM completion with
#: a logprob per token, or prompt logprobs over a long context), far below what would hurt the host.
MAX_REPLY_BYTES = 32 * 2**20


def _require_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise MissingDependencyError("httpx", "http", "HTTPPolicy") from exc
    return httpx


class JsonLinesCodec:
    """Messages <-> UTF-8 bytes of JSON lines (the HTTP policy's "tokens"; see the module docstring)."""

    eos_token_id = ord("\n")

    @staticmethod
    def encode_messages(messages: Sequence[Message]) -> list[int]:
        text = "".join(json.dumps(dict(m), ensure_ascii=False) + "\n" for m in messages)
        return list(text.encode("utf-8"))

    @staticmethod
    def decode_messages(ids: Sequence[int]) -> list[Message]:
        try:
            text = bytes(ids).decode("utf-8")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"HTTPPolicy got token ids that are not its UTF-8 JSON-lines encoding ({exc}); render the "
                "conversation with this policy's render()"
            ) from exc
        messages: list[Message] = []
        for n, line in enumerate(text.splitlines(), 1):
            try:
                message = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"HTTPPolicy transcript line {n} is not JSON ({exc}): {line[:80]!r}"
                ) from exc
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise ConfigError(f"HTTPPolicy transcript line {n} is not a chat message: {line[:80]!r}")
            messages.append(message)
        return messages

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Reply:
    """A whole HTTP reply, read within its deadline and size cap (:func:`read_reply`)."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not, or nests too deeply to read: a reply that
        someone else wrote never raises a raw ``RecursionError``)."""
        try:
            return json.loads(self.content)
        except RecursionError:
            raise ValueError(f"the reply ({len(self.content)} bytes) nests too deeply to read") from None


async def read_reply(
    client: Any, method: str, url: str, *, timeout_s: float, max_bytes: int = MAX_REPLY_BYTES, **request: Any
) -> Reply:
    """Send one request with ``client`` (an ``httpx.AsyncClient``) and read all of its reply, or fail.

    httpx's timeouts bound each connect, write and read, so a server that sends a byte every few
    seconds would hold a request for ever; ``timeout_s`` here bounds the whole exchange. The body is
    read in chunks and refused as soon as it grows past ``max_bytes`` (or at once, when its
    ``Content-Length`` says it will), so a huge reply costs at most the cap in memory. Bodies are asked
    for unencoded (``Accept-Encoding: identity``), so the cap counts what is kept: a compressed body
    (a few kilobytes that inflate to gigabytes) is refused.

    Raises:
        TimeoutError: no whole reply within ``timeout_s`` (the caller names the server).
        httpx.TransportError: the connection failed.
        PolicyError: the reply is too large or encoded.
    """
    headers = {"Accept-Encoding": "identity", **request.pop("headers", {})}
    async with asyncio.timeout(timeout_s), client.stream(method, url, headers=headers, **request) as response:
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise PolicyError(f"{url} answered with a {encoding!r}-encoded body; toolgym asked for none")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise PolicyError(
                f"{url} answered {int(declared):,} bytes; a reply may hold at most {max_bytes:,}"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > max_bytes:
                raise PolicyError(f"{url} answered more than {max_bytes:,} bytes; stopped reading there")
            chunks.append(chunk)
        return Reply(response.status_code, b"".join(chunks))


class HTTPPolicy:
    """An OpenAI-compatible chat-completions endpoint as a toolgym policy (see the module docstring).

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name.
        api_key: sent as a bearer token when set.
        send_tools: also send the system message's tool schemas as the request's ``tools``.
        timeout_s: the deadline of one try, the whole reply read (see the module docstring).
        retries: retries after the first try, for connection errors, timeouts, 429 and 5xx.
        backoff_s: first backoff; doubles on each retry.
        max_reply_bytes: the largest reply read; a larger one is a ``PolicyError``.
    """

    name = "http"
    token_exact = False

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        send_tools: bool = True,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self._httpx = _require_httpx()
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://, got {base_url!r}")
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ConfigError(
                f"need retries >= 0, timeout_s > 0, backoff_s >= 0 (got {retries}, {timeout_s}, {backoff_s})"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.send_tools = send_tools
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_reply_bytes = max_reply_bytes
        self.tokenizer = JsonLinesCodec()
        self.eos_token_id = JsonLinesCodec.eos_token_id
        self.policy_version = 0
        #: what the rollout reads of the format: calls come back as ``hermes`` text (module docstring)
        self.chat_format: ChatFormat = HermesFormat()

    def render(
        self, messages: Sequence[Message], *, continuation: bool = False, close_turn: bool = False
    ) -> list[int]:
        """JSON-lines bytes of ``messages`` (a completion is always a whole line, so the flags change nothing)."""
        return JsonLinesCodec.encode_messages(messages)

    def request_body(self, messages: Sequence[Message], sampling: SamplingParams) -> dict[str, Any]:
        """The chat-completions request for a transcript (public so a test can check it exactly)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": openai_messages(messages),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        schemas = tool_schemas(messages) if self.send_tools else []
        if schemas:
            body["tools"] = schemas
        return body

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """Send the transcript encoded in ``token_ids`` and return the assistant's turn."""
        messages = JsonLinesCodec.decode_messages(token_ids)
        if not messages:
            raise ConfigError("generate() needs at least one message (render the chat first)")
        data = await self._post(self.request_body(messages, sampling))
        try:
            choice = data["choices"][0]
            text = turn_text(choice["message"])
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise PolicyError(f"{self.url} answered without a chat completion: {str(data)[:200]}") from exc
        if not isinstance(text, str):
            raise PolicyError(f"{self.url} answered a chat turn that is not text: {str(choice)[:200]}")
        used = (data.get("usage") or {}).get("completion_tokens") if isinstance(data, dict) else None
        if isinstance(used, int) and used > sampling.max_tokens:
            raise PolicyError(
                f"{self.url} answered {used} completion tokens for a request of max_tokens={sampling.max_tokens}"
            )
        finish: Literal["stop", "length"] = "length" if choice.get("finish_reason") == "length" else "stop"
        ids = JsonLinesCodec.encode_messages([{"role": "assistant", "content": text}])
        return Completion(
            token_ids=tuple(ids),
            logprobs=(0.0,) * len(ids),
            text=text,
            finish_reason=finish,
            policy_version=0,
        )

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        httpx = self._httpx
        last = ""
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    response = await read_reply(
                        client,
                        "POST",
                        self.url,
                        json=body,
                        timeout_s=self.timeout_s,
                        max_bytes=self.max_reply_bytes,
                    )
                except (httpx.TransportError, TimeoutError) as exc:  # connection refused/reset, timeouts
                    last = (
                        f"{type(exc).__name__}: {str(exc) or f'no whole reply within {self.timeout_s:g} s'}"
                    )
                    logger.warning(
                        "POST %s failed (%s); attempt %d/%d", self.url, last, attempt + 1, self.retries + 1
                    )
                    continue
                if response.status_code in _RETRY_STATUS:
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                    logger.warning(
                        "POST %s: %s; attempt %d/%d", self.url, last, attempt + 1, self.retries + 1
                    )
                    continue
                if response.status_code >= 400:
                    raise ConfigError(
                        f"{self.url} refused the request with HTTP {response.status_code}: {response.text[:500]}"
                    )
                try:
                    return response.json()
                except ValueError as exc:
                    raise PolicyError(f"{self.url} answered with non-JSON: {response.text[:200]!r}") from exc
        raise PolicyError(f"{self.url} failed after {self.retries + 1} tries; last error: {last}")
