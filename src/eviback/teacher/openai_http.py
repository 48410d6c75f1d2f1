"""The OpenAI-compatible HTTP backend (`POST {base_url}/chat/completions`).

Works with vLLM's server, llama.cpp's server, llama-cpp-python's server and hosted APIs. Structured output
is requested in the form the server understands (`structured_output`):

- `response_format` (default): OpenAI's `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`; accepted by OpenAI, vLLM (it turns it into its own structured outputs) and llama.cpp's server;
- `structured_outputs`: vLLM's native field `{"structured_outputs": {"json": schema}}`;
- `json_object`: `{"type": "json_object", "schema": schema}` (llama-cpp-python's server);
- `none`: nothing; the reply is parsed robustly (first JSON object, or a bare status label).

A server that rejects the structured-output field (HTTP 400/422) is asked again once without it, and the
client stays on `none` from then on (logged), so a hosted API without JSON schema support still works.

Every call has a timeout. This class makes one attempt per `complete`; retries with backoff belong to the
judge, which also counts them.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from eviback.settings import check_fields
from eviback.teacher.chat import ChatReply, ChatRequest, PermanentError, TransientError

log = logging.getLogger(__name__)

# The default teacher server. Not port 8000, which `vllm serve` and llama-cpp-python's server would take by
# default: 8000 is the retrieval service's (`eviback serve`, the port of Search-R1's retriever, whose rollout
# code calls 127.0.0.1:8000/retrieve), and both run on one machine. Start the teacher with `--port 8001`.
DEFAULT_PORT = 8001
DEFAULT_BASE_URL = f"http://127.0.0.1:{DEFAULT_PORT}/v1"


class StructuredOutput(enum.StrEnum):
    RESPONSE_FORMAT = "response_format"
    STRUCTURED_OUTPUTS = "structured_outputs"
    JSON_OBJECT = "json_object"
    NONE = "none"


@dataclass(frozen=True)
class HttpBackendConfig:
    """Where and how to reach an OpenAI-compatible chat endpoint."""

    base_url: str = DEFAULT_BASE_URL  # up to and including /v1
    model: str = ""  # the served model name; "" asks the server (GET /models) and takes its first model
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the API key ("" or unset: none sent)
    structured_output: StructuredOutput = StructuredOutput.RESPONSE_FORMAT  # see the module docstring
    timeout_s: float = 60.0  # per call (connect, read, write); a hung server becomes a retryable error
    max_connections: int = 32  # should be >= the judge's concurrency
    max_tokens_field: str = "max_tokens"  # some hosted models want "max_completion_tokens"

    def __post_init__(self) -> None:
        check_fields(self)  # types first (`structured_output` a StructuredOutput): the checks below compare
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {self.base_url!r} must start with http:// or https://")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s={self.timeout_s} (the --timeout option) must be > 0: every call needs a "
                             "timeout")
        if self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections} must be >= 1 (at least the judge's concurrency)")
        if not self.max_tokens_field:
            raise ValueError("max_tokens_field must name the request field of the completion budget: max_tokens, or "
                             "max_completion_tokens for some hosted models")


_RETRYABLE_STATUS = {408, 409, 425, 429}


class OpenAIChatClient:
    """A thread-safe client of one OpenAI-compatible endpoint (see the module docstring)."""

    def __init__(self, config: HttpBackendConfig = HttpBackendConfig()) -> None:
        self.config = config
        headers = {}
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.Client(
            base_url=config.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s),
            limits=httpx.Limits(max_connections=config.max_connections,
                                max_keepalive_connections=config.max_connections),
        )
        self._mode = config.structured_output
        self._lock = threading.Lock()
        self._model = config.model

    @property
    def model(self) -> str:
        if not self._model:
            with self._lock:
                if not self._model:
                    self._model = self.list_models()[0]
        return self._model

    @property
    def backend_id(self) -> str:
        return f"openai-http:{self.model}"

    @property
    def structured_output(self) -> StructuredOutput:
        """The mode in use (it drops to `none` if the server rejected the configured one)."""
        return self._mode

    def list_models(self) -> list[str]:
        """The served model names (GET /models). Raises PermanentError/TransientError naming the fix."""
        try:
            response = self._http.get("/models")
        except httpx.HTTPError as e:
            raise TransientError(f"cannot reach {self.config.base_url}/models: {type(e).__name__}: {e}; "
                                 f"is the server running and is base_url right (it ends in /v1)?") from None
        if response.status_code != 200:
            raise PermanentError(f"GET {self.config.base_url}/models answered HTTP {response.status_code}: "
                                 f"{response.text[:200]}; check base_url and the API key")
        models = [m.get("id") for m in response.json().get("data", []) if m.get("id")]
        if not models:
            raise PermanentError(f"{self.config.base_url} serves no model; pass the model name explicitly")
        return models

    def _body(self, request: ChatRequest, mode: StructuredOutput) -> dict[str, Any]:
        decoding = request.decoding
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m.role, "content": m.content} for m in request.messages],
            "temperature": decoding.temperature,
            "top_p": decoding.top_p,
            self.config.max_tokens_field: decoding.max_tokens,
        }
        if request.seed is not None:
            body["seed"] = request.seed
        schema = request.schema.json_schema()
        if mode is StructuredOutput.RESPONSE_FORMAT:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": f"stage_{request.stage}", "schema": schema,
                                                       "strict": True}}
        elif mode is StructuredOutput.STRUCTURED_OUTPUTS:
            body["structured_outputs"] = {"json": schema}
        elif mode is StructuredOutput.JSON_OBJECT:
            body["response_format"] = {"type": "json_object", "schema": schema}
        return body

    def complete(self, request: ChatRequest) -> ChatReply:
        mode = self._mode
        start = time.perf_counter()
        response = self._post(request, mode)
        if response.status_code in (400, 422) and mode is not StructuredOutput.NONE:
            # The server may not know this structured-output field: ask again without it, and keep doing so.
            retry = self._post(request, StructuredOutput.NONE)
            if retry.status_code == 200:
                if self._mode is mode:
                    log.warning("%s rejected structured output %r (HTTP %d: %s); continuing without it and "
                                "parsing replies leniently", self.config.base_url, mode.value,
                                response.status_code, response.text[:200])
                    self._mode = StructuredOutput.NONE
                response = retry
        latency = time.perf_counter() - start
        status = response.status_code
        if status != 200:
            message = f"HTTP {status} from {self.config.base_url}: {response.text[:200]!r}"
            if status >= 500 or status in _RETRYABLE_STATUS:
                raise TransientError(message)
            raise PermanentError(message + "; check the model name, the API key and the request options")
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise TransientError(f"malformed response body from {self.config.base_url}: "
                                 f"{response.text[:120]!r}") from None
        if not isinstance(text, str):
            raise TransientError(f"no message content in the response: {response.text[:120]!r}")
        usage = data.get("usage") or {}
        return ChatReply(text=text, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                         completion_tokens=int(usage.get("completion_tokens") or 0), latency_s=latency,
                         truncated=choice.get("finish_reason") == "length")

    def _post(self, request: ChatRequest, mode: StructuredOutput) -> httpx.Response:
        try:
            return self._http.post("/chat/completions", json=self._body(request, mode))
        except httpx.TimeoutException:
            raise TransientError(f"timed out after {self.config.timeout_s:g}s ({self.config.base_url}); "
                                 f"raise timeout_s if the server is just slow") from None
        except httpx.HTTPError as e:
            raise TransientError(f"{type(e).__name__} talking to {self.config.base_url}: {e}") from None

    def close(self) -> None:
        self._http.close()
