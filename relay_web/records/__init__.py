"""Validated records: every request is parsed into one, every response is built as one."""
