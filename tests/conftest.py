"""Test-wide settings: a stall must fail a test run fast instead of hanging CI."""
import os

os.environ.setdefault("NEOCOMM_TIMEOUT", "120")
