"""Text environments as gymnax environments with on-device render and parse."""
