"""Sample metadata keys that several rollout modules read (kept here to avoid import cycles)."""

PROMPT_TOO_LONG_KEY = "prompt_too_long"  # metadata: prompt tokens of a prompt that was not sent
