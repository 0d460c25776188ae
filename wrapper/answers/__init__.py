"""The request path: which way a request goes, its passes to llama-server through the gate, and the answer loop
that makes one answer of them through growths, lost servers, hand-overs and pauses."""
