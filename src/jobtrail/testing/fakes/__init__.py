"""Contract fakes: loopback servers answering with each real API's documented wire shapes and faults."""
