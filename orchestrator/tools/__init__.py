"""Offline tools above the runtime: ``mxload convert`` (a converted checkpoint folder) and the
synthetic checkpoints the demo, tests and benches build."""
