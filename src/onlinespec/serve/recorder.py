"""Moved: the writer thread is :mod:`onlinespec.serve.writer` (:class:`~onlinespec.serve.writer.RecordWriter`).
This module keeps the old import path ``onlinespec.serve.recorder.Recorder`` working."""

from onlinespec.serve.writer import Recorder, RecordWriter

__all__ = ["RecordWriter", "Recorder"]
