"""Command-line tools: client, demo (the main job), checkpoint builders, health probe, process helpers."""
