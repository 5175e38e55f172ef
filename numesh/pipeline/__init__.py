"""Pipeline schedules and their executor (not yet implemented)."""
