"""What one request may ask for, shared by ``ggpipe serve`` (OpenAI's limits)
and ``ggpipe batch`` so that a request valid in one is valid in the other."""

from __future__ import annotations

#: Chat roles a request may use ("developer" is OpenAI's newer name for "system").
ROLES = ("system", "developer", "user", "assistant")
#: Highest temperature (OpenAI's range is [0, 2]).
TEMPERATURE_MAX = 2.0
#: Most stop strings per request (OpenAI allows 4; llama.cpp's server more).
STOP_MAX = 16
#: Most chat messages per request (a 4 MB body holds 100k one-word messages; a
#: conversation that fills a context of 32k tokens holds far fewer).
MESSAGES_MAX = 4096


def template_role(role: str) -> str:
    """The role as chat templates know it ("developer" -> "system")."""
    return "system" if role == "developer" else role
