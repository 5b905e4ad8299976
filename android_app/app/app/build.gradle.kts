// The app module. C++ is not built here: android_app/build_android.sh builds
// libzl_jni.so for arm64-v8a against ExecuTorch and libsodium built for
// Android (which the Gradle/CMake integration cannot find on its own), and
// this module packages the result from build-android/jniLibs.
plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// <repo>/build-android/jniLibs/arm64-v8a/libzl_jni.so, written by build_android.sh.
val zlJniLibs: File = rootProject.file("../../build-android/jniLibs")
val zlJniLibrary: File = File(zlJniLibs, "arm64-v8a/libzl_jni.so")

android {
    namespace = "com.zerolock.zl"
    compileSdk = 35

    defaultConfig {
        applicationId = "com.zerolock.zl"
        // Android 8.0: the API level the native code is built for (build_android.sh).
        minSdk = 26
        targetSdk = 35
        versionCode = 1
        versionName = "0.1.0"
        ndk {
            // The runner is built and tuned for arm64 phones only.
            abiFilters += "arm64-v8a"
        }
    }

    sourceSets["main"].jniLibs.srcDir(zlJniLibs)

    buildTypes {
        release {
            isMinifyEnabled = true
            proguardFiles(getDefaultProguardFile("proguard-android-optimize.txt"), "proguard-rules.pro")
        }
    }

    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_11
        targetCompatibility = JavaVersion.VERSION_11
    }
    kotlinOptions {
        jvmTarget = "11"
    }
    packaging {
        // Store the library uncompressed and page-aligned in the APK, so it
        // is mapped in place rather than extracted.
        jniLibs.useLegacyPackaging = false
    }
}

dependencies {
    implementation("androidx.core:core-ktx:1.13.1")
}

// Fail with the fix instead of an APK that throws UnsatisfiedLinkError.
val checkZlJniLibrary by tasks.registering {
    val library = zlJniLibrary
    doLast {
        if (!library.isFile) {
            throw GradleException(
                "$library is missing: build it first with android_app/build_android.sh " +
                    "(see android_app/README.md)",
            )
        }
    }
}
tasks.named("preBuild") { dependsOn(checkZlJniLibrary) }
