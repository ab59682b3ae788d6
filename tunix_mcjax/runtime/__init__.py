"""Step loops: colocated (LoCoJAX-CO) and disaggregated (LoCoJAX-DA)."""
