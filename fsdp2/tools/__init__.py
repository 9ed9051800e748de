"""Tools built on the public API: auto-sharding, the planner, the torch swap, full parameters, the grad scaler, gradient clipping."""
