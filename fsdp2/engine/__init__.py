"""The engine: what runs around every forward and backward of a sharded module."""
