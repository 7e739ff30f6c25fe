"""Test-only references: plain, obviously right, slow; the oracles the tests compare the ops against."""
