"""The developer tools that are not tests: mutation runs and their report, planted bugs, the Cloud
Storage emulator the suite runs against (docs/tests.md)."""
