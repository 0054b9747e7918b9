"""The users of the engine: the command line, the batch job, the demo."""
