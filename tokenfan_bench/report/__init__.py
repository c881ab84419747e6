"""What the bench writes: one run's outputs, and ``tokenfan bench report``'s matrix, verdicts, markdown and
plots."""
