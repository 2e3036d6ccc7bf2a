"""Agents over HTTP: the HTTP gateway every rank serves with ``workload=agent`` (``server``), its protocol
adapters (``protocols``), the model's chat template (``chat``), sessions that keep the engine's exact
token ids (``session``) and tool-call parsers (``toolcalls``). See docs/agents.md."""
