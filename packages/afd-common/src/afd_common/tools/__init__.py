"""Tools for people and tests, never imported by a serving role: afd-selftest, afd-bench, afd-demo,
afd-tiny-model, the GPU check and the server launcher they share."""
