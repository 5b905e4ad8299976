# CMake toolchain file: a statically linked aarch64 Linux executable (the
# phone binary, tools/build_phone_runner.sh, issue 41). Debian's aarch64 GCC
# and its static glibc (libc6-dev-arm64-cross), plus the multiarch arm64
# static archives (libsodium-dev:arm64, libgtest-dev:arm64) that
# tools/aarch64-linux.cmake finds. The result needs only a Linux kernel: it
# runs on Android from /data/local/tmp as it does here under qemu-aarch64.
include(${CMAKE_CURRENT_LIST_DIR}/aarch64-linux.cmake)
# -static: glibc, libstdc++, libsodium, gtest all from their .a archives.
set(CMAKE_EXE_LINKER_FLAGS_INIT "-static")
# A static executable has no loader to point at: qemu with nothing from the
# host's userland (no -L, no LD_LIBRARY_PATH), which is how gtest discovery
# and ctest run every test binary.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
