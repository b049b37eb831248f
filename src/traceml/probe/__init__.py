"""Inside training: the step probe, its phase patches, device clocks, memory and the sender."""
