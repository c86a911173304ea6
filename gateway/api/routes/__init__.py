"""One thin router per endpoint group: parse, call the serving class, shape the HTTP response."""
