"""Gradio studio."""
