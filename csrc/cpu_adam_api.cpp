// C ABI of zenflow's CPU optimizer library, loaded from Python with ctypes.
extern "C" __attribute__((visibility("default"))) int zf_abi_version() { return 1; }
