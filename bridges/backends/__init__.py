"""Alternative bridge backends behind the same interface as `bridges.bridge.Bridge`."""
