"""What tests and benches share and the product never runs: the CPU a figure was measured on
(`machine`), an emulated slow, lossy link between network namespaces (`link_emulator`)."""
