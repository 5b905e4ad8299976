// The app module. Gradle builds libzl_jni.so itself (externalNativeBuild):
// android_app/CMakeLists.txt, the same CMake entry that
// tools/build_android.sh uses for zl_runner, for arm64-v8a only, linked
// statically against ExecuTorch and libsodium built for Android. Gradle
// cannot find those two on its own; it takes their install prefixes from
// Gradle properties or, failing that, environment variables:
//
//   zl.executorchPrefix    / EXECUTORCH_ANDROID_PREFIX   ExecuTorch 1.5.1 installed for arm64-v8a (required)
//   zl.sodiumPrefix        / ZL_SODIUM_ANDROID_PREFIX    libsodium built for arm64-v8a (required)
//   zl.nlohmannJsonInclude / NLOHMANN_JSON_INCLUDE_DIR   folder holding nlohmann/json.hpp (default /usr/include)
//   zl.openblasPrefix      / ZL_OPENBLAS_ANDROID_PREFIX  OpenBLAS built for arm64-v8a (optional: else Eigen's GEMM)
//   zl.nativeBuildType     / ZL_BUILD_TYPE               CMake build type of the C++ (default Release)
//
// e.g. ./gradlew assembleDebug -Pzl.executorchPrefix=$HOME/et-android-arm64-v8a -Pzl.sodiumPrefix=...
// (or put the properties in ~/.gradle/gradle.properties). tools/build_android.sh checks every
// prerequisite first and passes them; android_app/README.md says how to build the two prefixes.
plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

/** Android 8.0: the floor ExecuTorch's own Android build uses; the native code is built for it too. */
val zlMinSdk = 26

/** The value of Gradle property [property], else of environment variable [envVar] (properties win); null if neither is set. */
fun zlSetting(property: String, envVar: String): String? =
    providers.gradleProperty(property).orNull?.takeIf { it.isNotBlank() }
        ?: providers.environmentVariable(envVar).orNull?.takeIf { it.isNotBlank() }

/**
 * An absolute folder named by [property] / [envVar] (or [default]); fails the configuration, with the
 * fix, when it is not set, not absolute or lacks one of [required] (paths relative to it).
 */
fun zlFolder(property: String, envVar: String, what: String, required: List<String>, default: String? = null): File {
    val value = zlSetting(property, envVar) ?: default ?: throw GradleException(
        "$what is not set: pass -P$property=/its/prefix (or put $property in ~/.gradle/gradle.properties, " +
            "or export $envVar). android_app/README.md says how to build it; " +
            "tools/build_android.sh --check checks all prerequisites.",
    )
    val folder = File(value)
    if (!folder.isAbsolute) {
        throw GradleException("$property / $envVar = '$value' is not an absolute path; give the full path to $what.")
    }
    val missing = required.filter { !File(folder, it).isFile }
    if (missing.isNotEmpty()) {
        throw GradleException(
            "$property / $envVar = $folder has no ${missing.joinToString(" and ")}: it is not $what. " +
                "See android_app/README.md; tools/build_android.sh --check says what is wrong.",
        )
    }
    return folder
}

val zlExecutorchPrefix = zlFolder(
    "zl.executorchPrefix", "EXECUTORCH_ANDROID_PREFIX",
    "the install prefix of ExecuTorch 1.5.1 built for arm64-v8a",
    listOf("lib/cmake/ExecuTorch/executorch-config.cmake"),
)
val zlSodiumPrefix = zlFolder(
    "zl.sodiumPrefix", "ZL_SODIUM_ANDROID_PREFIX",
    "the install prefix of libsodium built for arm64-v8a",
    listOf("include/sodium.h", "lib/libsodium.a"),
)
val zlNlohmannJson = zlFolder(
    "zl.nlohmannJsonInclude", "NLOHMANN_JSON_INCLUDE_DIR",
    "a folder holding nlohmann/json.hpp (nlohmann_json 3.x)",
    listOf("nlohmann/json.hpp"),
    default = "/usr/include",
)
val zlEigen = zlFolder(
    "zl.eigenInclude", "ZL_EIGEN_INCLUDE_DIR",
    "a folder holding Eigen/Core (Eigen 3.3 or 3.4; Debian: libeigen3-dev)",
    listOf("Eigen/Core"),
    default = "/usr/include/eigen3",
)
// Optional: OpenBLAS for the GEMM of zl's kernels (docs/design#kernels); without it, Eigen's.
val zlOpenblasPrefix: File? = zlSetting("zl.openblasPrefix", "ZL_OPENBLAS_ANDROID_PREFIX")?.let {
    zlFolder("zl.openblasPrefix", "ZL_OPENBLAS_ANDROID_PREFIX", "the install prefix of OpenBLAS built for arm64-v8a",
        listOf("lib/libopenblas.a"))
}
val zlNativeBuildType = zlSetting("zl.nativeBuildType", "ZL_BUILD_TYPE") ?: "Release"

// Only the nlohmann headers may go on the Android include path: a host folder
// such as /usr/include would put glibc headers in front of the NDK's. A folder
// that holds nothing but nlohmann/ (what tools/build_android.sh passes, or a
// release's single_include/) is used as it is; any other is copied, nlohmann/
// only, into the build folder before CMake configures.
val zlNlohmannJsonIsolated = zlNlohmannJson.listFiles()?.all { it.name == "nlohmann" } == true
val zlNlohmannJsonInclude: File =
    if (zlNlohmannJsonIsolated) zlNlohmannJson else layout.buildDirectory.dir("zl/nlohmann_json/include").get().asFile
if (!zlNlohmannJsonIsolated) {
    val syncNlohmannJson = tasks.register<Sync>("zlSyncNlohmannJson") {
        description = "Copies $zlNlohmannJson/nlohmann (only) to $zlNlohmannJsonInclude for the CMake build."
        from(File(zlNlohmannJson, "nlohmann")) { into("nlohmann") }
        into(zlNlohmannJsonInclude)
    }
    // configureCMake<Variant>[<abi>] runs CMake's configure step, which checks for the header.
    tasks.configureEach {
        if (name.startsWith("configureCMake") || name.startsWith("buildCMake")) dependsOn(syncNlohmannJson)
    }
}

android {
    namespace = "com.zerolock.zl"
    compileSdk = 35
    buildToolsVersion = "35.0.0"
    // NDK r28c: what ExecuTorch's own CI builds with. Gradle installs it into the SDK on
    // first use if the SDK licences are accepted (or: sdkmanager 'ndk;28.2.13676358').
    ndkVersion = "28.2.13676358"

    defaultConfig {
        applicationId = "com.zerolock.zl"
        minSdk = zlMinSdk
        targetSdk = 35
        versionCode = 1
        versionName = "0.1.0"
        ndk {
            // The runner is built and tuned for arm64 phones only.
            abiFilters += "arm64-v8a"
        }
        externalNativeBuild {
            cmake {
                // The same configuration as tools/build_android.sh passes (android_app/README.md, "Build").
                arguments(
                    "-DANDROID_PLATFORM=android-$zlMinSdk",
                    "-DANDROID_STL=c++_static",
                    "-DANDROID_SUPPORT_FLEXIBLE_PAGE_SIZES=ON",
                    "-Dexecutorch_DIR=$zlExecutorchPrefix/lib/cmake/ExecuTorch",
                    "-DCMAKE_FIND_ROOT_PATH=$zlExecutorchPrefix",
                    "-DZL_SODIUM_PREFIX=$zlSodiumPrefix",
                    "-DZL_NLOHMANN_JSON_INCLUDE_DIR=$zlNlohmannJsonInclude",
                    "-DZL_EIGEN_INCLUDE_DIR=$zlEigen",
                    // Optimized C++ in the debug APK too: that APK is the one `zl deploy --mode app`
                    // installs, and the runner's optimizer loop runs every step. (Given after the
                    // plugin's own -DCMAKE_BUILD_TYPE, so it wins.)
                    "-DCMAKE_BUILD_TYPE=$zlNativeBuildType",
                )
                if (zlOpenblasPrefix != null) arguments("-DZL_OPENBLAS_PREFIX=$zlOpenblasPrefix")
                // The JNI library only; zl_runner (the adb binary) is tools/build_android.sh's.
                targets("zl_jni")
            }
        }
    }

    externalNativeBuild {
        cmake {
            path = file("../../CMakeLists.txt")
            // ExecuTorch's installed package config needs CMake 3.24+. Gradle installs this
            // version into the SDK on first use (or: sdkmanager 'cmake;3.31.6'), or uses a
            // cmake of exactly this version found on PATH.
            version = "3.31.6"
        }
    }

    buildTypes {
        release {
            // No signing config here: assembleRelease writes app-release-unsigned.apk,
            // which you sign with your own key (android_app/README.md, "Build").
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
    // Unit tests (src/test, `./gradlew test`): the Kotlin that needs no Android classes. android.jar's
    // org.json is a stub there, so they get the real one.
    testImplementation("junit:junit:4.13.2")
    testImplementation("org.json:json:20231013")
}
