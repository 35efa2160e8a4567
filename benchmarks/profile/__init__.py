"""One-off profiles of the engine step: where a decode or prefill step's time goes."""
