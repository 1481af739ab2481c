"""Test doubles shipped as real code: a fake clock, fake peers."""
