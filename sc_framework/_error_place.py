"""Errors that say where they happened: "batch 2 of the training data: ...".

An error raised while reading one item of many (a batch of a dataset) names
the problem but not the item; the caller that knows the item puts it in front.
"""

from __future__ import annotations


def name_the_place(error: Exception, where: str) -> None:
  """Starts the error's message with `where`: "batch 2 of the training data: ...".

  The error keeps its type, attributes and traceback. An error whose message is not
  its first argument (a str) gets `where` as a note instead.
  """
  if error.args and isinstance(error.args[0], str) and str(error) == error.args[0]:
    error.args = (f"{where}: {error.args[0]}",) + error.args[1:]
  else:
    error.add_note(f"(in {where})")
