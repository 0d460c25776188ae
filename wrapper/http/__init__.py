"""The public HTTP face: /health, status, metrics, the wrapper's own POSTs and who may ask what; every other
request goes to the request path (wrapper/answers/)."""
