"""Development tools, never imported at run time: the tiny-checkpoint maker (`python -m tools.tiny`)."""
