# CMake toolchain file: aarch64 Linux (glibc) with Debian's cross GCC and
# multiarch arm64 packages, for tools/check_arm64.sh. Not Android: the NDK
# build is tools/build_android.sh.
#
#   apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user
#   dpkg --add-architecture arm64 && apt-get update
#   apt-get install libsodium-dev:arm64 libgtest-dev:arm64
#   cmake -S . -B build-arm64/cmake --toolchain tools/aarch64-linux.cmake \
#     -DCMAKE_PREFIX_PATH=<aarch64 executorch wheel>/executorch/share/cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Debian's cross GCC searches the multiarch folders /usr/lib/aarch64-linux-gnu
# and /usr/include itself, so no CMAKE_SYSROOT; CMake's own find_* calls reach
# the same folders through CMAKE_LIBRARY_ARCHITECTURE (aarch64-linux-gnu).
# The host's x86 libraries live in /usr/lib/x86_64-linux-gnu and are not seen.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# pkg-config must hand out the arm64 libsodium, not the host's.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
unset(ENV{PKG_CONFIG_PATH})
# gtest_discover_tests runs each test binary after linking to list its tests,
# and ctest runs the tests; under a cross build CMake puts this emulator in
# front. -L makes /lib/ld-linux-aarch64.so.1 the cross toolchain's loader; the
# cross toolchain's lib folder must then come first in the search path: the
# loader also searches /lib/aarch64-linux-gnu, where the multiarch libc6:arm64
# (pulled in by libsodium-dev:arm64) is another glibc build, and that loader
# with that libc.so.6 hangs the first pthread_create (qemu 7.2, glibc
# 2.36-8cross1 vs 2.36-9+deb12u14). The multiarch folder after it, for libsodium.
set(ZL_AARCH64_QEMU
  qemu-aarch64 -L /usr/aarch64-linux-gnu
  -E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib:/usr/lib/aarch64-linux-gnu)
set(CMAKE_CROSSCOMPILING_EMULATOR ${ZL_AARCH64_QEMU})
