// The ZeroLock app shell: one module, `:app`. Its native library comes
// prebuilt from android_app/build_android.sh (build-android/jniLibs).
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
