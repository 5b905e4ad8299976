// Versions as in ExecuTorch's own Android project (extension/android):
// Android Gradle Plugin 8.9.0 on Gradle 8.11.1, Kotlin 1.9.23.
plugins {
    id("com.android.application") version "8.9.0" apply false
    id("org.jetbrains.kotlin.android") version "1.9.23" apply false
}
