"""Engine-agnostic context core: wire rules, token provenance, the event compiler and its program."""
