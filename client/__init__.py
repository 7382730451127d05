"""Client API: submit, defer, cancel and read tasks."""
