"""The report layer: a run's figures and findings built from the store (or, live, the
collector) and the diagnosis rules, for the views to show."""
