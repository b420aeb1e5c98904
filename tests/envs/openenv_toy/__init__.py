"""Toy OpenEnv environments for tests/envs/test_openenv.py, written in OpenEnv's own format (Action /
Observation models, an Environment subclass, `create_app`), served with uvicorn by the tests."""
