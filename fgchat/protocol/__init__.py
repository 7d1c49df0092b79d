"""Messages, errors and configuration shared by the engine and its clients (no torch import)."""
