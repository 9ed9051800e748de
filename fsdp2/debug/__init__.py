"""Debugging aids beneath the engine: deadlines on collectives, the hang report, collective checks."""
