// The ZeroLock app shell: one module, `:app`, which also builds its native
// library (libzl_jni.so) from runner/ and android_app/jni with CMake. The whole build,
// with its prerequisite checks: tools/build_android.sh (android_app/README.md).
pluginManagement {
    repositories {
        google()
        mavenCentral()
        gradlePluginPortal()
    }
}

dependencyResolutionManagement {
    repositoriesMode.set(RepositoriesMode.FAIL_ON_PROJECT_REPOS)
    repositories {
        google()
        mavenCentral()
    }
}

rootProject.name = "zerolock"
include(":app")
