"""The calculator tool task's agent fn (official `openai` client) and its final-answer reward."""
