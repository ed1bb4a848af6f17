"""The terminal-use coding environment: an agent fn with shell, read and edit tools over a sandbox, its
pass-fraction reward, the task data and a scripted teacher's transcripts for SFT."""
