"""SGLang's real server as the system under test: its launch, its CPU stand-ins, its model."""
