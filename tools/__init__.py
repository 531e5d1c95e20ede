"""Development tools, never imported at run time: the tiny-checkpoint maker (`python -m engine make-tiny`)."""
